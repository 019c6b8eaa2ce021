"""The synthetic-model writer: a file llama.cpp and meshnet read as the shape asked for."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnet.benchmark.llama3_vocab import Vocabulary, read_hf_vocabulary
from meshnet.benchmark.synthetic_model import (
    Llama3RopeScaling,
    LlamaShape,
    llama3_rope_factors,
    tensor_plan,
    write_model,
)
from meshnet.errors import ModelError
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import read_spec

TINY = LlamaShape(
    n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256
)


def _vocab() -> Vocabulary:
    tokens = [chr(0x100 + i) for i in range(256)] + ["<|begin_of_text|>", "<|eot_id|>"]
    types = [int(gguf.TokenType.NORMAL)] * 256 + [int(gguf.TokenType.CONTROL)] * 2
    return Vocabulary(
        tokens=tokens,
        types=types,
        merges=[f"{chr(0x100)} {chr(0x101)}"],
        bos_id=256,
        eos_id=257,
        eot_id=257,
        add_bos=True,
        chat_template="{{ messages[0]['content'] }}",
    )


def _write(tmp_path: Path, shape: LlamaShape = TINY, seed: int = 7, name: str = "m") -> Path:
    path = tmp_path / f"{name}.gguf"
    write_model(path, shape, _vocab(), seed=seed, weight_type="f16")
    return path


def _field(r: gguf.GGUFReader, key: str) -> object:
    return r.fields[key].contents()


def test_metadata_is_the_llama3_converter_keys(tmp_path: Path) -> None:
    r = gguf.GGUFReader(_write(tmp_path))
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.block_count") == 2
    assert _field(r, "llama.attention.head_count_kv") == 2
    assert _field(r, "llama.attention.key_length") == 16
    assert _field(r, "llama.rope.freq_base") == 500000.0
    assert _field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert _field(r, "tokenizer.ggml.pre") == "llama-bpe"
    assert (_field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")) == (
        256,
        257,
    )
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    assert isinstance(tokens, list) and isinstance(types, list)
    assert len(tokens) == len(types) == 300  # padded up to the embedding's rows
    assert tokens[299] == "[PAD299]" and types[299] == int(gguf.TokenType.USER_DEFINED)
    assert not any(k.startswith("llama.rope.scaling.") for k in r.fields)  # rope_freqs instead


def test_tensors_have_the_planned_names_shapes_and_types(tmp_path: Path) -> None:
    r = gguf.GGUFReader(_write(tmp_path))
    got = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in r.tensors}
    want = {p.name: p.shape for p in tensor_plan(TINY)}
    assert {n: s for n, (_, s) in got.items()} == want
    assert "output.weight" not in got  # tied to the embedding
    assert got["blk.1.attn_k.weight"] == (gguf.GGMLQuantizationType.F16, (32, 64))
    assert got["blk.0.ffn_norm.weight"][0] == gguf.GGMLQuantizationType.F32
    assert got["rope_freqs.weight"] == (gguf.GGMLQuantizationType.F32, (8,))


def test_weights_are_seeded_and_at_realistic_scale(tmp_path: Path) -> None:
    a = gguf.GGUFReader(_write(tmp_path, name="a"))
    b = gguf.GGUFReader(_write(tmp_path, name="b"))
    other = gguf.GGUFReader(_write(tmp_path, seed=8, name="c"))
    fewer = gguf.GGUFReader(
        _write(tmp_path, LlamaShape(**{**TINY.__dict__, "n_layers": 1}), name="d")
    )

    def data(r: gguf.GGUFReader, name: str) -> np.ndarray:
        return np.asarray(next(t for t in r.tensors if t.name == name).data, dtype=np.float32)

    gate = data(a, "blk.0.ffn_gate.weight")
    assert np.array_equal(gate, data(b, "blk.0.ffn_gate.weight"))
    assert not np.array_equal(gate, data(other, "blk.0.ffn_gate.weight"))
    assert np.array_equal(gate, data(fewer, "blk.0.ffn_gate.weight"))  # a layer does not
    # depend on how many follow it: a short test model is the big one's prefix
    assert np.isfinite(gate).all() and 0.018 < gate.std() < 0.022 and abs(gate.mean()) < 0.002
    norm = data(a, "blk.1.attn_norm.weight")
    assert norm.min() > 0.9 and norm.max() < 1.1


def test_meshnet_reads_the_shape_back(tmp_path: Path) -> None:
    spec = read_spec(open_gguf(_write(tmp_path)))
    assert (spec.n_layers, spec.d_model, spec.d_ff) == (2, 64, 128)
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim) == (4, 2, 16)
    assert (spec.vocab_size, spec.context_length, spec.tied_head) == (300, 256, True)
    assert (spec.bos_id, spec.eos_id) == (256, 257)


def test_llama3_rope_factors_keep_short_wavelengths_and_divide_long_ones() -> None:
    scaling = Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
    f = llama3_rope_factors(64, 500000.0, scaling)
    assert f.shape == (32,) and f.dtype == np.float32
    assert f[0] == 1.0 and f[-1] == 32.0
    assert np.all(np.diff(f) >= 0)  # longer wavelengths are never divided less
    blended = f[(f > 1.0) & (f < 32.0)]
    assert len(blended) > 0  # wavelengths between 8192/4 and 8192 are blended


def test_vocabulary_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    small = LlamaShape(**{**TINY.__dict__, "vocab_size": 100})
    with pytest.raises(ModelError, match="do not fit"):
        write_model(tmp_path / "x.gguf", small, _vocab())
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_hf_vocabulary_marks_special_added_tokens_as_control(tmp_path: Path) -> None:
    hf = {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
        "added_tokens": [
            {"id": 3, "content": "<|begin_of_text|>", "special": True},
            {"id": 4, "content": "<|eot_id|>", "special": True},
            {"id": 5, "content": "<tool>", "special": False},
        ],
        "decoder": {"type": "ByteLevel"},
    }
    config = {"bos_token": "<|begin_of_text|>", "chat_template": "{{ x }}"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(hf))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    v = read_hf_vocabulary(tmp_path)
    assert v.tokens == ["a", "b", "ab", "<|begin_of_text|>", "<|eot_id|>", "<tool>"]
    control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
    assert v.types[3:] == [control, control, user]
    assert (v.bos_id, v.eos_id, v.eot_id, v.merges) == (3, 4, 4, ["a b"])
    assert v.chat_template == "{{ x }}"
