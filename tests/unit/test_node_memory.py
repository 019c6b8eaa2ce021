"""What a node must hold, the yardstick of its RSS in bench/realistic.py."""

from __future__ import annotations

import os

from meshnet.benchmark.node_memory import Rss, session_kv_bytes, shard_file_bytes
from meshnet.layer_range import LayerRange


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


def test_kv_of_a_sequence_is_what_the_cache_allocates() -> None:
    # 3 layers x (K and V) x 2 heads x 64 positions (the cache's least capacity) x 8 dims x 4 B
    assert session_kv_bytes(LayerRange(0, 3), 2, 8, 10) == 3 * 2 * 2 * 64 * 8 * 4
    assert session_kv_bytes(LayerRange(0, 3), 2, 8, 100) == 3 * 2 * 2 * 100 * 8 * 4


def test_rss_of_this_process_is_read() -> None:
    rss = Rss.of(os.getpid())
    assert rss.total > 0 and rss.anon + rss.file <= rss.total + 4096
