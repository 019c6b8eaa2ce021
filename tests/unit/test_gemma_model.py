"""The Gemma 3 benchmark model: a file meshnet loads as gemma3 with llama.cpp's window
layout and tensor set, a vocabulary of Gemma's size and layout that round-trips text,
the real 270M's parameter count and shapes, and the quantized file made once."""

from __future__ import annotations

import stat
from itertools import pairwise
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnet.benchmark.gemma_model import (
    GemmaShape,
    ensure_gemma_model,
    model_stem,
    parameter_count,
    tensor_plan,
    write_gemma_model,
)
from meshnet.benchmark.gemma_vocab import GEMMA3_VOCAB_SIZE, synthetic_vocabulary
from meshnet.engine.local import load_local_model
from meshnet.errors import ModelError
from meshnet.model import weights
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.tokenizer import load_tokenizer

# Six layers (one window pattern), query heads wider than the model (4 x 32 over 64) and
# one KV head, as the 270M's 4 x 256 over 640; a window a test prompt runs past
SMALL = GemmaShape(
    n_layers=6,
    d_model=64,
    n_heads=4,
    n_kv_heads=1,
    head_dim=32,
    d_ff=128,
    vocab_size=2048,
    context_length=512,
    sliding_window=16,
)
F32 = gguf.GGMLQuantizationType.F32
CONTROL, UNKNOWN = int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNKNOWN)
BYTE, NORMAL = int(gguf.TokenType.BYTE), int(gguf.TokenType.NORMAL)


@pytest.fixture(scope="module")
def small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma") / "gemma3-small.gguf"
    write_gemma_model(path, SMALL, seed=0, weight_type="f32")
    return path


def _llama_cpp_gemma3_tensors(n_layers: int) -> set[str]:
    """What llama.cpp's gemma3.cpp creates, the head tied (no output.weight)."""
    per_layer = (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm",
        "attn_k_norm", "attn_q_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
        "post_ffw_norm",
    )  # fmt: skip
    names = {"token_embd.weight", "output_norm.weight"}
    return names | {f"blk.{i}.{t}.weight" for i in range(n_layers) for t in per_layer}


def test_metadata_is_the_gemma3_converter_keys(small_path: Path) -> None:
    f = open_gguf(small_path)
    assert f.value("general.architecture") == "gemma3"
    want = {
        "block_count": 6,
        "context_length": 512,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 1,
        "attention.key_length": 32,
        "attention.value_length": 32,
        "attention.sliding_window": 16,
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 10_000.0,
    }
    assert {k: f.value(f"gemma3.{k}") for k in want} == want
    assert f.value("gemma3.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert not f.has("gemma3.attention.sliding_window_pattern")  # llama.cpp's 6 applies
    assert f.value("general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    tokenizer = {
        "model": "llama",
        "pre": "default",
        "bos_token_id": 2,
        "eos_token_id": 1,
        "unknown_token_id": 3,
        "padding_token_id": 0,
        "add_bos_token": True,
        "add_eos_token": False,
        "add_space_prefix": False,
    }
    assert {k: f.value(f"tokenizer.ggml.{k}") for k in tokenizer} == tokenizer


def test_the_tensors_are_llama_cpps_gemma3_set_and_meshnet_reads_each(
    small_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = open_gguf(small_path)
    assert set(f.tensors) == _llama_cpp_gemma3_tensors(6)
    assert [t.name for t in tensor_plan(SMALL)] == list(f.tensors)
    # ggml's order (ne: the row first), as gemma3.cpp creates them; 1-D tensors F32
    got = {n: (t.tensor_type, tuple(int(x) for x in t.shape)) for n, t in f.tensors.items()}
    assert got["token_embd.weight"] == (F32, (64, 2048))
    assert got["blk.5.attn_q.weight"][1] == (64, 128)  # {n_embd, n_embd_head_k * n_head}
    assert got["blk.5.attn_k.weight"][1] == (64, 32)
    assert got["blk.5.attn_output.weight"][1] == (128, 64)
    assert got["blk.5.attn_q_norm.weight"] == (F32, (32,))
    assert got["blk.5.ffn_down.weight"][1] == (128, 64)
    read: list[str] = []
    checked = weights.checked_tensor

    def recording(f: GGUFFile, name: str, shape: tuple[int, ...]) -> gguf.ReaderTensor:
        read.append(name)
        return checked(f, name, shape)

    monkeypatch.setattr(weights, "checked_tensor", recording)
    load_local_model(small_path)
    assert set(read) == set(f.tensors)  # nothing missing (it would raise), nothing unread


def test_meshnet_runs_it_as_gemma3_with_five_of_six_layers_windowed(small_path: Path) -> None:
    m = load_local_model(small_path)
    s = m.spec
    assert s.architecture == "gemma3" and s.tied_head and s.qk_norm and s.post_norms
    assert s.windowed == tuple(SMALL.is_windowed(i) for i in range(6))
    assert s.windowed == (True, True, True, True, True, False)
    assert [s.layer_window(i) for i in range(6)] == [16] * 5 + [0]
    assert (s.layer_rope(0).base, s.layer_rope(5).base) == (10_000.0, 1_000_000.0)
    assert (s.head_dim, s.q_width, s.n_kv_heads, s.vocab_size) == (32, 128, 1, 2048)
    prompt = m.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    assert len(prompt) > SMALL.sliding_window  # the local layers' window is passed
    logits = m.chain.forward(np.asarray(prompt), [m.chain.new_sequence()], [len(prompt)])
    assert logits.shape == (1, 2048) and np.isfinite(logits).all() and logits.std() > 0


def test_the_tokenizer_round_trips_text(small_path: Path) -> None:
    t = load_tokenizer(open_gguf(small_path))
    for text in ("Hello, world!", " two  spaces\tand a tab\n", "naïve café, 東京 😀", ""):
        ids = t.encode(text, add_special=False)
        assert t.decode(ids) == text
        assert t.encode(text) == [2, *ids]  # bos prepended, no eos
    assert t.eos_id == 1 and 1 in t.eog_ids


def test_the_vocabulary_is_gemmas_size_and_layout() -> None:
    v = synthetic_vocabulary()
    n = GEMMA3_VOCAB_SIZE
    assert len(v.tokens) == len(v.scores) == len(v.types) == n == 262_144
    assert len(set(v.tokens)) == n
    assert v.tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert v.types[:4] == [CONTROL, CONTROL, CONTROL, UNKNOWN]
    assert v.tokens[4:260] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(v.types[4:260]) == {BYTE} and set(v.types[260:]) == {NORMAL}
    assert all(a > b for a, b in pairwise(v.scores[260:]))
    assert v.tokens[: SMALL.vocab_size] == synthetic_vocabulary(SMALL.vocab_size).tokens


def test_the_default_shape_is_gemma3_270m() -> None:
    shape = GemmaShape()
    assert parameter_count(shape) == 268_098_176
    plan = {t.name: t.shape for t in tensor_plan(shape)}
    assert len(plan) == 2 + 13 * 18 and "output.weight" not in plan
    assert plan["token_embd.weight"] == (262_144, 640)
    assert plan["blk.17.attn_q.weight"] == (1024, 640)
    assert plan["blk.17.attn_k.weight"] == plan["blk.17.attn_v.weight"] == (256, 640)
    assert plan["blk.17.attn_output.weight"] == (640, 1024)
    assert plan["blk.17.attn_q_norm.weight"] == (256,)
    assert plan["blk.17.ffn_gate.weight"] == (2048, 640)
    assert plan["blk.17.ffn_down.weight"] == (640, 2048)
    assert [i for i in range(18) if not shape.is_windowed(i)] == [5, 11, 17]
    assert (shape.sliding_window, shape.context_length) == (512, 32_768)
    assert model_stem(shape, 0) == "gemma3-270m-synthetic-s0"
    assert model_stem(SMALL, 0) != model_stem(SMALL, 1) != model_stem(shape, 1)


def test_the_f32_source_is_quantized_and_deleted(tmp_path: Path) -> None:
    fake = tmp_path / "llama-quantize"  # llama-quantize SRC DST TYPE THREADS
    fake.write_text('#!/bin/sh\ncp "$1" "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "models"
    made = ensure_gemma_model(SMALL, 0, "Q4_K_M", out, fake, lambda _: None)
    assert made.name == f"{model_stem(SMALL, 0)}-Q4_K_M.gguf" and made.is_file()
    assert [p.name for p in out.iterdir()] == [made.name]  # no F32 left behind
    assert ensure_gemma_model(SMALL, 0, "Q4_K_M", out, None, lambda _: None) == made


def test_no_quantizer_or_an_impossible_shape_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="llama-quantize"):
        ensure_gemma_model(SMALL, 0, "Q4_K_M", tmp_path, None, lambda _: None)
    for bad in ({"n_kv_heads": 3}, {"vocab_size": 300}, {"sliding_window": 0}):
        with pytest.raises(ModelError):
            write_gemma_model(tmp_path / "x.gguf", GemmaShape(**{**SMALL.__dict__, **bad}))
    assert not list(tmp_path.iterdir())
