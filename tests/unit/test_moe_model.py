"""The Qwen3-MoE benchmark model: a file meshnet's GGUF reader parses as llama.cpp's
converter writes Qwen3-MoE, a router whose softmax is peaked, and the bytes a token reads."""

from __future__ import annotations

import stat
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnet.benchmark.bandwidth import decode_bytes, read_gb_s
from meshnet.benchmark.llama3_vocab import Vocabulary
from meshnet.benchmark.model_bench import step_bytes
from meshnet.benchmark.moe_model import MoeShape, ensure_moe_model, tensor_plan, write_moe_model
from meshnet.errors import ModelError
from meshnet.model.gguf_file import open_gguf

# 16 experts of 4 used; a query width (4 x 32) twice the model width, as Qwen3-30B-A3B's
SMALL = MoeShape(
    n_layers=2,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    n_experts=16,
    n_experts_used=4,
    d_ff_expert=32,
    vocab_size=300,
    context_length=256,
)
F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16


def _vocab() -> Vocabulary:
    tokens = [chr(0x100 + i) for i in range(256)] + ["<|begin_of_text|>", "<|eot_id|>"]
    types = [int(gguf.TokenType.NORMAL)] * 256 + [int(gguf.TokenType.CONTROL)] * 2
    return Vocabulary(tokens, types, [f"{chr(0x100)} {chr(0x101)}"], 256, 257, 257, True, None)


def _write(tmp_path: Path, weight_type: str = "f16", seed: int = 0) -> Path:
    path = tmp_path / f"moe-{weight_type}-{seed}.gguf"
    write_moe_model(path, SMALL, _vocab(), seed=seed, weight_type=weight_type)
    return path


def test_metadata_is_the_qwen3moe_converter_keys(tmp_path: Path) -> None:
    f = open_gguf(_write(tmp_path))
    assert f.value("general.architecture") == "qwen3moe"
    want = {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 4 * 32,  # HF intermediate_size: the experts used, together
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 32,
        "attention.value_length": 32,
        "expert_count": 16,
        "expert_used_count": 4,
        "expert_feed_forward_length": 32,
        "rope.freq_base": 1_000_000.0,
        "context_length": 256,
    }
    assert {k: f.value(f"qwen3moe.{k}") for k in want} == want
    assert f.value("qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert not f.has("qwen3moe.rope.dimension_count")  # the converter writes none for Qwen3
    assert f.value("general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert f.value("tokenizer.ggml.pre") == "llama-bpe"


def test_tensors_have_llama_cpps_names_shapes_and_types(tmp_path: Path) -> None:
    f = open_gguf(_write(tmp_path))
    # ggml's order (ne: the row first), as llama.cpp's qwen3moe.cpp creates them
    got = {n: (t.tensor_type, tuple(int(x) for x in t.shape)) for n, t in f.tensors.items()}
    assert len(got) == 2 + 12 * 2 + 1
    assert got["token_embd.weight"] == (F16, (64, 300))
    assert got["output.weight"] == (F16, (64, 300))  # untied, as every Qwen3-MoE
    assert got["output_norm.weight"] == (F32, (64,))
    layer = {k.removeprefix("blk.1."): v for k, v in got.items() if k.startswith("blk.1.")}
    assert layer == {
        "attn_norm.weight": (F32, (64,)),
        "attn_q.weight": (F16, (64, 128)),
        "attn_k.weight": (F16, (64, 64)),
        "attn_v.weight": (F16, (64, 64)),
        "attn_q_norm.weight": (F32, (32,)),
        "attn_k_norm.weight": (F32, (32,)),
        "attn_output.weight": (F16, (128, 64)),
        "ffn_norm.weight": (F32, (64,)),
        "ffn_gate_inp.weight": (F32, (64, 16)),  # the router stays F32
        "ffn_gate_exps.weight": (F16, (64, 32, 16)),  # {n_embd, n_ff_exp, n_expert}
        "ffn_up_exps.weight": (F16, (64, 32, 16)),
        "ffn_down_exps.weight": (F16, (32, 64, 16)),  # {n_ff_exp, n_embd, n_expert}
    }
    assert [t.name for t in tensor_plan(SMALL)] == list(f.tensors)


def test_experts_are_seeded_per_expert_slice(tmp_path: Path) -> None:
    a = open_gguf(_write(tmp_path, "f32"))
    b = open_gguf(_write(tmp_path, "f32", seed=1))
    gate = np.asarray(a.tensors["blk.0.ffn_gate_exps.weight"].data).reshape(16, 32, 64)
    other = np.asarray(b.tensors["blk.0.ffn_gate_exps.weight"].data).reshape(16, 32, 64)
    assert not np.array_equal(gate, other)
    assert not np.array_equal(gate[0], gate[1])  # every expert its own weights
    assert 0.018 < gate.std() < 0.022 and abs(gate.mean()) < 0.002


def test_the_router_softmax_is_peaked(tmp_path: Path) -> None:
    f = open_gguf(_write(tmp_path, "f32"))
    router = np.asarray(f.tensors["blk.0.ffn_gate_inp.weight"].data).reshape(16, 64)
    x = np.random.default_rng(3).standard_normal((2000, 64)).astype(np.float32)  # RMS ~1
    logits = x @ router.T
    assert 1.7 < logits.std() < 2.3  # the shape's router_logit_std
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = np.sort(p, axis=1)[:, ::-1]
    assert top[:, 0].mean() > 4 / 16  # uniform would give each expert 1/16
    assert top[:, :4].sum(axis=1).mean() > 0.6


def test_a_token_reads_its_used_experts_and_the_head(tmp_path: Path) -> None:
    f = open_gguf(_write(tmp_path))
    sizes = {n: int(t.n_bytes) for n, t in f.tensors.items()}
    experts = sum(n for name, n in sizes.items() if name.endswith("_exps.weight"))
    whole = sum(sizes.values()) - sizes["token_embd.weight"]
    assert step_bytes(f) == whole - experts + experts * 4 // 16
    assert decode_bytes(sizes) == whole  # a dense reading counts every expert


def test_the_f32_source_is_quantized_and_deleted(tmp_path: Path) -> None:
    fake = tmp_path / "llama-quantize"  # llama-quantize SRC DST TYPE THREADS
    fake.write_text('#!/bin/sh\ncp "$1" "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "models"
    made = ensure_moe_model(SMALL, 0, "Q4_K_M", out, fake, lambda _: None, _vocab())
    assert made.name.endswith("-Q4_K_M.gguf") and made.is_file()
    assert [p.name for p in out.iterdir()] == [made.name]  # no F32 left behind
    assert ensure_moe_model(SMALL, 0, "Q4_K_M", out, None, lambda _: None, _vocab()) == made


def test_no_quantizer_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="llama-quantize"):
        ensure_moe_model(SMALL, 0, "Q4_K_M", tmp_path, None, lambda _: None, _vocab())
    assert not list(tmp_path.iterdir())


def test_impossible_shapes_are_refused(tmp_path: Path) -> None:
    too_many = MoeShape(**{**SMALL.__dict__, "n_experts_used": 17})
    with pytest.raises(ModelError, match="more experts"):
        write_moe_model(tmp_path / "x.gguf", too_many, _vocab())
    assert not list(tmp_path.iterdir())


def test_the_bound_measures_as_many_threads_as_decode_runs() -> None:
    # the threads each read their own part; a tiny buffer only checks the plumbing
    assert read_gb_s(buffer_mb=4, passes=1, threads=2) > 0
