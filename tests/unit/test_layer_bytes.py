"""A model's bytes by part, from its header: what ranges are planned and reported by."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tinyarch import CASES, write_arch_gguf
from tinymodel import TinyConfig, add_tokenizer, finish, write_tiny_gguf

from meshnet.errors import LayerRangeError, ModelFileError
from meshnet.kv.cache import SequenceKV
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.layer_bytes import (
    LayerBytes,
    float32_bytes,
    kv_bytes,
    layer_bytes_of,
    model_layer_bytes,
)
from meshnet.model.spec import read_spec


def _sizes(path: Path) -> tuple[GGUFFile, LayerBytes]:
    f = open_gguf(path)
    return f, model_layer_bytes(f, read_spec(f))


def _tensor_bytes(f: GGUFFile) -> int:
    return sum(int(t.n_bytes) for t in f.tensors.values())


def _all_ranges_bytes(sizes: LayerBytes, parts: int) -> int:
    return sum(sizes.range_bytes(r) for r in sizes.split(parts))


def test_a_tiny_layer_is_the_bytes_of_its_blocks(tmp_path: Path) -> None:
    f, sizes = _sizes(write_tiny_gguf(tmp_path / "t.gguf", TinyConfig()))
    # Q8_0 (34 bytes per 32 weights): q and o 64x64, k and v 32x64, gate, up and down
    # 128x64; two float32 norms of 64.
    q8 = 34 // 2  # bytes per 16 weights
    expected = (2 * 4096 + 2 * 2048 + 3 * 8192) // 16 * q8 + 2 * 64 * 4
    assert sizes.layers == (expected,) * 4
    assert sizes.total == _tensor_bytes(f)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_untied_ranges_hold_the_files_tensor_bytes_once(tmp_path: Path, parts: int) -> None:
    f, sizes = _sizes(write_tiny_gguf(tmp_path / "u.gguf", TinyConfig(tied_head=False)))
    assert not sizes.tied_head and sizes.shared == 0
    assert _all_ranges_bytes(sizes, parts) == _tensor_bytes(f)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_a_tied_head_is_the_embedding_held_again_by_the_last_range(
    tmp_path: Path, parts: int
) -> None:
    f, sizes = _sizes(write_tiny_gguf(tmp_path / "t.gguf", TinyConfig(tied_head=True)))
    assert sizes.tied_head and sizes.embedding == f.tensors["token_embd.weight"].n_bytes
    assert _all_ranges_bytes(sizes, parts) == _tensor_bytes(f) + sizes.embedding
    assert _all_ranges_bytes(sizes, 1) == _tensor_bytes(f)  # one node: the embedding once
    last = sizes.split(parts)[-1]
    assert sizes.range_bytes(last) == sum(sizes.layers[last.start :]) + sizes.last_bytes


@pytest.mark.parametrize("case", ["llama3", "gemma3", "phi3", "qwen2"])
def test_every_family_s_tensors_are_counted(tmp_path: Path, case: str) -> None:
    f, sizes = _sizes(write_arch_gguf(tmp_path / f"{case}.gguf", CASES[case]))
    extra = sizes.embedding if sizes.tied_head else 0
    # rope_freqs (llama3) is read by every layer: each range holds it.
    assert _all_ranges_bytes(sizes, 2) == _tensor_bytes(f) + sizes.shared + extra
    assert sizes.shared == (int(f.tensors["rope_freqs.weight"].n_bytes) if case == "llama3" else 0)


def test_the_reference_backend_holds_four_bytes_per_weight(tmp_path: Path) -> None:
    f = open_gguf(write_tiny_gguf(tmp_path / "t.gguf", TinyConfig(tied_head=False)))
    sizes = model_layer_bytes(f, read_spec(f), float32_bytes)
    assert sizes.total == 4 * sum(int(t.n_elements) for t in f.tensors.values())


def test_kv_per_token_is_what_the_cache_allocates_per_position(tmp_path: Path) -> None:
    _, sizes = _sizes(write_tiny_gguf(tmp_path / "t.gguf", TinyConfig()))
    layers = LayerRange(1, 3)
    per_position = SequenceKV(len(layers), 2, 16).growth_bytes(64) // 64  # 2 kv heads of 16
    assert sizes.kv_bytes_per_token(layers) == per_position == 2 * 2 * 2 * 16 * 4


def test_kv_bytes_caps_each_windowed_layer_at_its_window() -> None:
    assert kv_bytes([0, 8, 24], 10, 5) == 10 * (5 + 5 + 5)  # short of every window
    assert kv_bytes([0, 8, 24], 10, 20) == 10 * (20 + 8 + 20)
    assert kv_bytes([0, 8, 24], 10, 100) == 10 * (100 + 8 + 24)
    assert kv_bytes([], 10, 100) == 0


def test_planning_and_preflight_count_windowed_layers_at_their_window(tmp_path: Path) -> None:
    """A Gemma-3-shaped file (6 layers, 2 and 5 global, a window of 8): a node's KV per
    token is the global layers' rate plus the windows spread over the context, far
    under counting every layer dense."""
    _, sizes = _sizes(write_arch_gguf(tmp_path / "g.gguf", CASES["gemma3"]))
    per, ctx = sizes.kv_layer_token, sizes.context
    assert sizes.windows == (8, 8, 0, 8, 8, 0)
    assert sizes.kv_bytes(LayerRange(0, 6), 1000) == (2 * 1000 + 4 * 8) * per
    assert sizes.kv_bytes(LayerRange(3, 5), 1000) == 2 * 8 * per  # windowed only
    assert sizes.kv_bytes_per_token(LayerRange(0, 6)) == -(-(2 * ctx + 4 * 8) * per // ctx)
    assert sizes.kv_bytes_per_token(LayerRange(0, 6)) < 6 * per / 2


def _moe_gguf(path: Path, dense: int = 2, moe: int = 4, n_experts: int = 8) -> Path:
    """A llama-family file of ``dense`` dense layers, then ``moe`` mixture-of-experts
    layers (3-D tensors ``blk.N.ffn_*_exps.weight`` and a router, as llama.cpp writes
    them); float16 throughout, tied head."""
    d, ff, vocab = 32, 64, 300
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(dense + moe)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(2)
    add_tokenizer(w)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float16))

    tensor("token_embd.weight", vocab, d)
    for i in range(dense + moe):
        p = f"blk.{i}."
        for part in ("q", "k", "v", "output"):
            tensor(f"{p}attn_{part}.weight", d, d)
        if i < dense:
            for part in ("gate", "up"):
                tensor(f"{p}ffn_{part}.weight", ff, d)
            tensor(f"{p}ffn_down.weight", d, ff)
        else:
            tensor(f"{p}ffn_gate_inp.weight", n_experts, d)
            for part in ("gate", "up"):
                tensor(f"{p}ffn_{part}_exps.weight", n_experts, ff, d)
            tensor(f"{p}ffn_down_exps.weight", n_experts, d, ff)
    tensor("output_norm.weight", d)
    finish(w)
    return path


def test_expert_tensors_are_bytes_of_their_layer(tmp_path: Path) -> None:
    # From the header alone, whatever the spec makes of the experts.
    f = open_gguf(_moe_gguf(tmp_path / "moe.gguf"))
    sizes = layer_bytes_of({n: int(t.n_bytes) for n, t in f.tensors.items()}, 6, True)
    attention, dense_ffn = 4 * 32 * 32 * 2, 3 * 64 * 32 * 2  # float16
    experts = 8 * dense_ffn + 8 * 32 * 2  # and the router
    assert sizes.layers == (attention + dense_ffn,) * 2 + (attention + experts,) * 4
    assert sizes.total == _tensor_bytes(f)
    # The dense layers are light: the first node takes more layers than an even split's.
    assert sizes.split(2) == [LayerRange(0, 4), LayerRange(4, 6)]
    assert sizes.split(3) == [LayerRange(0, 3), LayerRange(3, 5), LayerRange(5, 6)]


def test_a_tensor_of_a_layer_the_model_lacks_is_a_typed_error() -> None:
    with pytest.raises(ModelFileError, match="layer 4 of 4"):
        layer_bytes_of({"blk.4.attn_q.weight": 10, "token_embd.weight": 5}, 4, True)


def test_a_range_outside_the_model_is_refused() -> None:
    sizes = layer_bytes_of({"blk.0.a": 1, "blk.1.a": 1, "token_embd.weight": 5}, 2, True)
    with pytest.raises(LayerRangeError):
        sizes.range_bytes(LayerRange(1, 3))
    with pytest.raises(LayerRangeError):
        sizes.split(3)
