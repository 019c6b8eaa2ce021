"""The weights one shard needs, and only those, dequantized to float32.

A shard of layers ``[start, end)`` reads the tensors of those blocks, plus
the token embedding when it is the first shard and the output norm and head
when it is the last (a tied head is the embedding itself, not a copy).
Arrays are read-only: weights are shared by every sequence a shard serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.errors import ModelFileError, UnsupportedTensorType
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.spec import ModelSpec

F32 = np.float32
FloatArray = np.ndarray

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
        QT.MXFP4,
    }
)


W = TypeVar("W")  # how a backend holds a weight matrix (float32 array, quantized blocks…)

# Reads one checked 2-D tensor of a file as a backend's matrix type.
MatrixReader = Callable[[GGUFFile, gguf.ReaderTensor, tuple[int, int]], W]


@dataclass(frozen=True)
class LayerWeights(Generic[W]):
    """One transformer block. Matrices are ``[out, in]`` so that ``y = x @ W.T``.

    Optional parts are None where the family has none (``ModelSpec`` says which).
    """

    attn_norm: FloatArray  # [d]
    qkv: tuple[W, ...]  # (wq, wk, wv), or one fused [q | k | v] matrix; q: [H * hd, d]
    wo: W  # [d, H * hd]
    ffn_norm: FloatArray  # [d]
    gate_up: tuple[W, ...]  # (w_gate, w_up) [d_ff, d] each, or one fused [gate | up]
    w_down: W  # [d, d_ff]
    qkv_bias: FloatArray | None = None  # [q | k | v] widths
    q_norm: FloatArray | None = None  # [hd], RMSNorm weight of each query head
    k_norm: FloatArray | None = None  # [hd]
    post_attn_norm: FloatArray | None = None  # [d]
    post_ffn_norm: FloatArray | None = None  # [d]


@dataclass(frozen=True)
class ShardWeights(Generic[W]):
    """Everything a shard of ``layers`` computes with."""

    layers: LayerRange
    blocks: tuple[LayerWeights[W], ...]  # blocks[i] is layer layers.start + i
    embedding: W | None  # [vocab, d], first shard only
    output_norm: FloatArray | None  # [d], last shard only
    head: W | None  # [vocab, d], last shard only; a tied head is the embedding object


def dequantized_matrix(f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int]) -> FloatArray:
    """A matrix as a read-only float32 array (the reference backend's weights)."""
    return dequantized(t, shape)


def dequantized(t: gguf.ReaderTensor, shape: tuple[int, ...]) -> FloatArray:
    """A tensor as a read-only float32 array of ``shape``."""
    try:
        values = gguf.quants.dequantize(t.data, QT(t.tensor_type))
    except (ValueError, NotImplementedError) as e:
        raise ModelFileError(f"tensor {t.name!r} cannot be dequantized: {e}") from e
    out = np.ascontiguousarray(np.asarray(values, dtype=F32).reshape(shape))
    out.setflags(write=False)
    return out


def load_shard_weights(
    f: GGUFFile,
    spec: ModelSpec,
    layers: LayerRange,
    matrix: MatrixReader[W] = dequantized_matrix,  # type: ignore[assignment]
) -> ShardWeights[W]:
    """Read the tensors of ``layers`` (and embedding/head at the ends); matrices via ``matrix``."""
    layers.check_within(spec.n_layers)
    d, vocab = spec.d_model, spec.vocab_size

    def vector(name: str, size: int) -> FloatArray:
        return dequantized(checked_tensor(f, name, (size,)), (size,))

    def mat(name: str, shape: tuple[int, int]) -> W:
        return matrix(f, checked_tensor(f, name, shape), shape)

    blocks = tuple(_load_block(vector, mat, spec, i) for i in layers)
    first, last = layers.is_first(), layers.is_last(spec.n_layers)
    embedding = mat("token_embd.weight", (vocab, d)) if first or (last and spec.tied_head) else None
    output_norm = vector("output_norm.weight", d) if last else None
    head: W | None = None
    if last:
        head = embedding if spec.tied_head else mat("output.weight", (vocab, d))
    return ShardWeights(layers, blocks, embedding if first else None, output_norm, head)


def _load_block(
    vector: Callable[[str, int], FloatArray],
    mat: Callable[[str, tuple[int, int]], W],
    spec: ModelSpec,
    i: int,
) -> LayerWeights[W]:
    d, q_width, kv_width, hd = spec.d_model, spec.q_width, spec.kv_width, spec.head_dim
    p = f"blk.{i}."
    widths = (q_width, kv_width, kv_width)
    if spec.fused_qkv:
        qkv: tuple[W, ...] = (mat(p + "attn_qkv.weight", (sum(widths), d)),)
    else:
        qkv = tuple(mat(p + f"attn_{n}.weight", (w, d)) for n, w in zip("qkv", widths, strict=True))
    bias = None
    if spec.qkv_bias:
        if spec.fused_qkv:
            bias = vector(p + "attn_qkv.bias", sum(widths))
        else:
            parts = [vector(p + f"attn_{n}.bias", w) for n, w in zip("qkv", widths, strict=True)]
            bias = np.concatenate(parts)
            bias.setflags(write=False)
    if spec.fused_gate_up:
        gate_up: tuple[W, ...] = (mat(p + "ffn_up.weight", (2 * spec.d_ff, d)),)
    else:
        gate_up = tuple(mat(p + f"ffn_{n}.weight", (spec.d_ff, d)) for n in ("gate", "up"))
    post = spec.post_norms
    return LayerWeights(
        attn_norm=vector(p + "attn_norm.weight", d),
        qkv=qkv,
        wo=mat(p + "attn_output.weight", (d, q_width)),
        ffn_norm=vector(p + "ffn_norm.weight", d),
        gate_up=gate_up,
        w_down=mat(p + "ffn_down.weight", (d, spec.d_ff)),
        qkv_bias=bias,
        q_norm=vector(p + "attn_q_norm.weight", hd) if spec.qk_norm else None,
        k_norm=vector(p + "attn_k_norm.weight", hd) if spec.qk_norm else None,
        post_attn_norm=vector(p + "post_attention_norm.weight", d) if post else None,
        post_ffn_norm=vector(p + "post_ffw_norm.weight", d) if post else None,
    )


def checked_tensor(f: GGUFFile, name: str, shape: tuple[int, ...]) -> gguf.ReaderTensor:
    """The tensor ``name``, after checking it exists, has a readable type and ``shape``."""
    t = f.tensors.get(name)
    if t is None:
        raise ModelFileError(f"{f.path.name}: tensor {name!r} is missing")
    qtype = QT(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"{f.path.name}: tensor {t.name!r} has type {qtype.name}")
    # GGUF lists dims innermost first; numpy wants them outermost first.
    gguf_shape = tuple(int(d) for d in reversed(t.shape))
    if gguf_shape != shape:
        raise ModelFileError(
            f"{f.path.name}: tensor {t.name!r} has shape {gguf_shape}, expected {shape}"
        )
    return t
