"""Write tiny random-weight llama GGUF files with ``gguf.GGUFWriter`` for fast tests.

The model is real in every way that matters to the engine (tokenizer, chat
template, quantized tensors, grouped-query attention) and small enough that a
forward pass takes microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import kquants
import numpy as np
from gguf import GGMLQuantizationType as QT

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUANTIZABLE = frozenset({QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0})  # by gguf-py
K_QUANTS = frozenset({QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K})  # by tests/kquants.py
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]


@dataclass(frozen=True)
class TinyConfig:
    n_layers: int = 4
    d_model: int = 64
    d_ff: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    context_length: int = 256
    architecture: str = "llama"
    matrix_type: QT = QT.Q8_0  # type of the block matrices
    embedding_type: QT = QT.Q4_1
    tied_head: bool = True
    seed: int = 0
    # layer index -> type, to mix quant types inside one file
    layer_types: dict[int, QT] = field(default_factory=dict)
    # tensor role ("attn_v", "ffn_down", "output", ...) -> type, as Q4_K_M files mix them
    role_types: dict[str, QT] = field(default_factory=dict)
    # strings of metadata beside the tiny vocabulary: a header as large as a real one's
    header_strings: int = 0
    chat_template: str = CHATML


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their llama.cpp types: specials (control), bytes, merge results."""
    tokens = SPECIALS + byte_tokens()
    for m in MERGES:
        merged = m.replace(" ", "")
        if merged not in tokens:
            tokens.append(merged)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def write_tiny_gguf(path: Path, cfg: TinyConfig = TinyConfig()) -> Path:
    """Write a tiny llama-family GGUF to ``path`` and return it."""
    rng = np.random.default_rng(cfg.seed)
    vocab = len(vocabulary()[0])
    head_dim = cfg.d_model // cfg.n_heads
    arch = cfg.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(w, cfg.chat_template)
    if cfg.header_strings:
        w.add_array("meshnet.test.padding", [f"{i:024d}" for i in range(cfg.header_strings)])

    def matrix(name: str, rows: int, cols: int, qtype: QT, scale: float = 0.2) -> None:
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        role = name.removesuffix(".weight").split(".")[-1]
        _add(w, name, data, cfg.role_types.get(role, qtype))

    matrix("token_embd.weight", vocab, cfg.d_model, cfg.embedding_type, scale=1.0)
    for i in range(cfg.n_layers):
        qt = cfg.layer_types.get(i, cfg.matrix_type)
        p = f"blk.{i}."
        _add(w, p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(cfg.d_model), QT.F32)
        matrix(p + "attn_q.weight", cfg.d_model, cfg.d_model, qt)
        matrix(p + "attn_k.weight", cfg.n_kv_heads * head_dim, cfg.d_model, qt)
        matrix(p + "attn_v.weight", cfg.n_kv_heads * head_dim, cfg.d_model, qt)
        matrix(p + "attn_output.weight", cfg.d_model, cfg.d_model, qt)
        _add(w, p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(cfg.d_model), QT.F32)
        matrix(p + "ffn_gate.weight", cfg.d_ff, cfg.d_model, qt)
        matrix(p + "ffn_up.weight", cfg.d_ff, cfg.d_model, qt)
        matrix(p + "ffn_down.weight", cfg.d_model, cfg.d_ff, qt)
    _add(w, "output_norm.weight", 1 + 0.1 * rng.standard_normal(cfg.d_model), QT.F32)
    if not cfg.tied_head:
        matrix("output.weight", vocab, cfg.d_model, cfg.matrix_type)
    finish(w)
    return path


def add_tokenizer(w: gguf.GGUFWriter, chat_template: str = CHATML) -> None:
    """The tiny byte-level BPE vocabulary, a chat template (ChatML), bos 1 / eos 2."""
    tokens, types = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)


def finish(w: gguf.GGUFWriter) -> None:
    """Write what ``w`` holds to its file and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT) -> None:
    data = np.asarray(data, dtype=np.float32)
    if qtype == QT.F32:
        w.add_tensor(name, data)
    elif qtype == QT.F16:
        w.add_tensor(name, data.astype(np.float16))
    elif qtype in QUANTIZABLE:
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    elif qtype in K_QUANTS and data.ndim == 2 and data.shape[1] % kquants.QK_K == 0:
        w.add_tensor(name, kquants.quantize(data, qtype), raw_dtype=qtype)
    else:  # a type (or a K-quant width) nothing here encodes: random bytes of the right size
        shape = gguf.quants.quant_shape_to_byte_shape(data.shape, qtype)
        raw = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
