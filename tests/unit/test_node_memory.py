"""What a node must hold, the yardstick of its RSS in bench/realistic.py."""

from __future__ import annotations

import os
from pathlib import Path

from tinyarch import CASES, write_arch_gguf

from meshnet.benchmark.node_memory import (
    Rss,
    planned_layout,
    session_kv_bytes,
    shard_file_bytes,
)
from meshnet.layer_range import LayerRange, split_evenly
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import read_spec


def _tensors(n_layers: int, tied: bool) -> dict[str, int]:
    names = {"rope_freqs.weight": 1, "token_embd.weight": 1000, "output_norm.weight": 2}
    if not tied:
        names["output.weight"] = 900
    for i in range(n_layers):
        names |= {f"blk.{i}.attn_q.weight": 10, f"blk.{i}.ffn_down.weight": 20}
    return names


def test_first_middle_and_last_shards_of_a_tied_model() -> None:
    t = _tensors(12, tied=True)
    assert shard_file_bytes(t, LayerRange(0, 4), 12) == 1 + 1000 + 4 * 30
    assert shard_file_bytes(t, LayerRange(4, 8), 12) == 1 + 4 * 30
    assert shard_file_bytes(t, LayerRange(8, 12), 12) == 1 + 1000 + 2 + 4 * 30  # the tied head


def test_an_untied_head_is_held_by_the_last_shard_only() -> None:
    t = _tensors(4, tied=False)
    assert shard_file_bytes(t, LayerRange(2, 4), 4) == 1 + 900 + 2 + 2 * 30
    whole = shard_file_bytes(t, LayerRange(0, 4), 4)
    assert whole == sum(t.values())  # one node holds every tensor once


def test_the_splits_measured_are_by_bytes_as_meshnet_up_plans_them() -> None:
    # an untied model: the embedding (1000) on the first range, the head (902) on the last
    t = _tensors(12, tied=False)
    layout = planned_layout(t, 12, 3)
    assert layout == [LayerRange(0, 1), LayerRange(1, 11), LayerRange(11, 12)]
    held = [shard_file_bytes(t, r, 12) for r in layout]
    assert max(held) < max(shard_file_bytes(t, r, 12) for r in split_evenly(12, 3))


def test_kv_of_a_sequence_caps_windowed_layers_at_their_window(tmp_path: Path) -> None:
    # Gemma-3-shaped: 6 layers, 2 and 5 global, the others a window of 8
    spec = read_spec(open_gguf(write_arch_gguf(tmp_path / "g.gguf", CASES["gemma3"])))
    per = 2 * spec.n_kv_heads * spec.head_dim * 4  # one layer, one position: K and V
    assert session_kv_bytes(LayerRange(0, 3), spec, 5) == 3 * 5 * per
    assert session_kv_bytes(LayerRange(0, 3), spec, 100) == (8 + 8 + 100) * per
    assert session_kv_bytes(LayerRange(0, 6), spec, 100) == (4 * 8 + 2 * 100) * per


def test_rss_of_this_process_is_read() -> None:
    rss = Rss.of(os.getpid())
    assert rss.total > 0 and rss.anon + rss.file <= rss.total + 4096
