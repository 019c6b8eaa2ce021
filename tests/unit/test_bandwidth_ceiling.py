"""The decode ceiling bench/realistic.py sets the split against: the bytes a batch-1
step reads, with the token embedding counted whole only where it is the head too."""

from __future__ import annotations

import pytest

from meshnet.benchmark.bandwidth import ceiling_tok_s, decode_bytes

LAYER = {"blk.0.attn_q.weight": 400, "blk.0.ffn_down.weight": 1200, "output_norm.weight": 8}


def test_a_tied_head_reads_the_whole_embedding_every_step() -> None:
    assert decode_bytes({**LAYER, "token_embd.weight": 5000}) == 1608 + 5000


def test_an_own_head_leaves_the_embedding_to_a_row_lookup() -> None:
    untied = {**LAYER, "token_embd.weight": 5000, "output.weight": 3000}
    assert decode_bytes(untied) == 1608 + 3000


def test_the_ceiling_is_bandwidth_over_step_bytes() -> None:
    assert ceiling_tok_s(34.0, 800_000_000) == pytest.approx(42.5)
