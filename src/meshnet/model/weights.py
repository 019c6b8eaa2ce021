"""The weights one shard needs, and only those, dequantized to float32.

A shard of layers ``[start, end)`` reads the tensors of those blocks, plus
the token embedding when it is the first shard and the output norm and head
when it is the last (a tied head is the embedding itself, not a copy).
Arrays are read-only: weights are shared by every sequence a shard serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.errors import ModelFileError, UnsupportedTensorType
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.spec import ModelSpec

F32 = np.float32
FloatArray = np.ndarray
TensorGetter = Callable[[str, tuple[int, ...]], FloatArray]

# Types the engine reads; ``gguf.quants`` dequantizes each of them in numpy.
SUPPORTED_TYPES = frozenset(
    {
        QT.F32,
        QT.F16,
        QT.BF16,
        QT.Q4_0,
        QT.Q4_1,
        QT.Q5_0,
        QT.Q5_1,
        QT.Q8_0,
        QT.Q2_K,
        QT.Q3_K,
        QT.Q4_K,
        QT.Q5_K,
        QT.Q6_K,
    }
)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Matrices are ``[out, in]`` so that ``y = x @ W.T``."""

    attn_norm: FloatArray  # [d]
    wq: FloatArray  # [n_heads * head_dim, d]
    wk: FloatArray  # [n_kv_heads * head_dim, d]
    wv: FloatArray  # [n_kv_heads * head_dim, d]
    wo: FloatArray  # [d, n_heads * head_dim]
    ffn_norm: FloatArray  # [d]
    w_gate: FloatArray  # [d_ff, d]
    w_up: FloatArray  # [d_ff, d]
    w_down: FloatArray  # [d, d_ff]


@dataclass(frozen=True)
class ShardWeights:
    """Everything a shard of ``layers`` computes with."""

    layers: LayerRange
    blocks: tuple[LayerWeights, ...]  # blocks[i] is layer layers.start + i
    embedding: FloatArray | None  # [vocab, d], first shard only
    output_norm: FloatArray | None  # [d], last shard only
    head: FloatArray | None  # [vocab, d], last shard only


def load_shard_weights(f: GGUFFile, spec: ModelSpec, layers: LayerRange) -> ShardWeights:
    """Read and dequantize the tensors of ``layers`` (and embedding/head at the ends)."""
    layers.check_within(spec.n_layers)
    tensors = f.tensors

    def get(name: str, shape: tuple[int, ...]) -> FloatArray:
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{f.path.name}: tensor {name!r} is missing")
        return _dequantize(f, t, shape)

    blocks = tuple(_load_block(get, spec, i) for i in layers)
    first, last = layers.is_first(), layers.is_last(spec.n_layers)
    embedding = get("token_embd.weight", (spec.vocab_size, spec.d_model)) if first else None
    output_norm = get("output_norm.weight", (spec.d_model,)) if last else None
    head: FloatArray | None = None
    if last:
        if spec.tied_head:
            head = (
                embedding
                if embedding is not None
                else get("token_embd.weight", (spec.vocab_size, spec.d_model))
            )
        else:
            head = get("output.weight", (spec.vocab_size, spec.d_model))
    return ShardWeights(layers, blocks, embedding, output_norm, head)


def _load_block(get: TensorGetter, spec: ModelSpec, i: int) -> LayerWeights:
    d, q_width, kv_width = spec.d_model, spec.n_heads * spec.head_dim, spec.kv_width
    p = f"blk.{i}."
    return LayerWeights(
        attn_norm=get(p + "attn_norm.weight", (d,)),
        wq=get(p + "attn_q.weight", (q_width, d)),
        wk=get(p + "attn_k.weight", (kv_width, d)),
        wv=get(p + "attn_v.weight", (kv_width, d)),
        wo=get(p + "attn_output.weight", (d, q_width)),
        ffn_norm=get(p + "ffn_norm.weight", (d,)),
        w_gate=get(p + "ffn_gate.weight", (spec.d_ff, d)),
        w_up=get(p + "ffn_up.weight", (spec.d_ff, d)),
        w_down=get(p + "ffn_down.weight", (d, spec.d_ff)),
    )


def _dequantize(f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, ...]) -> FloatArray:
    qtype = QT(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"{f.path.name}: tensor {t.name!r} has type {qtype.name}")
    # GGUF lists dims innermost first; numpy wants them outermost first.
    gguf_shape = tuple(int(d) for d in reversed(t.shape))
    if gguf_shape != shape:
        raise ModelFileError(
            f"{f.path.name}: tensor {t.name!r} has shape {gguf_shape}, expected {shape}"
        )
    try:
        values = gguf.quants.dequantize(t.data, qtype)
    except (ValueError, NotImplementedError) as e:
        raise ModelFileError(f"{f.path.name}: tensor {t.name!r} cannot be dequantized: {e}") from e
    out = np.ascontiguousarray(np.asarray(values, dtype=F32).reshape(shape))
    out.setflags(write=False)
    return out
