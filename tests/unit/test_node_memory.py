"""What a node must hold, the yardstick of its RSS in bench/realistic.py."""

from __future__ import annotations

import os

from meshnet.benchmark.node_memory import (
    Rss,
    session_kv_bytes,
    shard_file_bytes,
    shard_tensor_names,
)
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
    first = set(shard_tensor_names(t, LayerRange(0, 4), 12))
    middle = set(shard_tensor_names(t, LayerRange(4, 8), 12))
    last = set(shard_tensor_names(t, LayerRange(8, 12), 12))
    assert "token_embd.weight" in first and "token_embd.weight" in last  # the tied head
    assert "token_embd.weight" not in middle and "output_norm.weight" not in middle
    assert "blk.4.attn_q.weight" in middle and "blk.8.attn_q.weight" not in middle
    assert "blk.10.ffn_down.weight" in last and "blk.1.ffn_down.weight" not in last
    assert all("rope_freqs.weight" in s for s in (first, middle, last))
    assert shard_file_bytes(t, LayerRange(4, 8), 12) == 1 + 4 * 30


def test_an_untied_head_is_held_by_the_last_shard_only() -> None:
    t = _tensors(4, tied=False)
    last = shard_tensor_names(t, LayerRange(2, 4), 4)
    assert "output.weight" in last and "token_embd.weight" not in last
    whole = shard_file_bytes(t, LayerRange(0, 4), 4)
    assert whole == sum(t.values())  # one node holds every tensor once


def test_kv_of_a_sequence_is_what_the_cache_allocates() -> None:
    # 3 layers x (K and V) x 2 heads x 64 positions (the cache's least capacity) x 8 dims x 4 B
    assert session_kv_bytes(LayerRange(0, 3), 2, 8, 10) == 3 * 2 * 2 * 64 * 8 * 4
    assert session_kv_bytes(LayerRange(0, 3), 2, 8, 100) == 3 * 2 * 2 * 100 * 8 * 4


def test_rss_of_this_process_is_read() -> None:
    rss = Rss.of(os.getpid())
    assert rss.total > 0 and rss.anon + rss.file <= rss.total + 4096
