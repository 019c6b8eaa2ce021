"""A small llama GGUF with a Gemma-3-sized SentencePiece vocabulary, written by the tests.

Real files of this kind (Gemma 3 270M: 262k tokens, a Q8_0 embedding tied to the
head, Q4_K/Q6_K layers) spend as much on their vocabulary as on their layers, so
what a process keeps of a tokenizer shows next to the file's bytes. No such
file can be downloaded here; this one is made in a couple of seconds. Its
vocabulary grows the way BPE vocabularies grow (each piece an earlier piece and
one more character, scored by age), so prompts merge into long pieces, and its
pieces are about as long as Gemma's (~11 characters).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from tinymodel import _add, finish

ESCAPED_SPACE = "\u2581"
LETTERS = "abcdefghijklmnopqrstuvwxyzéàüñ" + ESCAPED_SPACE
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class LargeVocabConfig:
    n_tokens: int = 262_144  # Gemma 3's vocabulary
    n_layers: int = 4
    d_model: int = 256  # whole K-quant super-blocks
    d_ff: int = 512
    n_heads: int = 4
    n_kv_heads: int = 1  # as Gemma 3 270M
    context_length: int = 131_072  # a cache sized by the context would be seen at once
    seed: int = 0


def spm_vocabulary(n_tokens: int, seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types: <unk> <s> </s>, the 256 byte tokens, the letters, then
    pieces made of an earlier piece and one letter until there are ``n_tokens``."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *LETTERS]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(LETTERS)
    seen = set(tokens)
    rng = random.Random(seed)
    pieces = list(LETTERS)
    while len(tokens) < n_tokens:
        piece = rng.choice(pieces) + rng.choice(LETTERS)
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
            tokens.append(piece)
            types.append(NORMAL)
    scores = [0.0] * 259 + [-float(i) for i in range(n_tokens - 259)]
    return tokens, scores, types


def prompt_text(n_words: int, seed: int = 1) -> str:
    """Words of the vocabulary's letters, space-separated."""
    rng = random.Random(seed)
    letters = LETTERS[:-1]
    return " ".join("".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(n_words))


def write_large_vocab_gguf(path: Path, cfg: LargeVocabConfig = LargeVocabConfig()) -> Path:
    """The model at ``path``: Q8_0 embedding (the tied head), Q4_K layers with Q6_K values
    and down projections, as llama.cpp's Q4_K_M makes of Gemma 3 270M."""
    rng = np.random.default_rng(cfg.seed)
    head_dim = cfg.d_model // cfg.n_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    tokens, scores, types = spm_vocabulary(cfg.n_tokens, cfg.seed)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def matrix(name: str, rows: int, cols: int, qtype: QT) -> None:
        _add(w, name, rng.standard_normal((rows, cols), dtype=np.float32) * 0.2, qtype)

    def norm(name: str) -> None:
        _add(w, name, 1 + 0.1 * rng.standard_normal(cfg.d_model, dtype=np.float32), QT.F32)

    matrix("token_embd.weight", cfg.n_tokens, cfg.d_model, QT.Q8_0)
    kv = cfg.n_kv_heads * head_dim
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", cfg.d_model, cfg.d_model, QT.Q4_K)
        matrix(p + "attn_k.weight", kv, cfg.d_model, QT.Q4_K)
        matrix(p + "attn_v.weight", kv, cfg.d_model, QT.Q6_K)
        matrix(p + "attn_output.weight", cfg.d_model, cfg.d_model, QT.Q4_K)
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", cfg.d_ff, cfg.d_model, QT.Q4_K)
        matrix(p + "ffn_up.weight", cfg.d_ff, cfg.d_model, QT.Q4_K)
        matrix(p + "ffn_down.weight", cfg.d_model, cfg.d_ff, QT.Q6_K)
    norm("output_norm.weight")
    finish(w)
    return path
