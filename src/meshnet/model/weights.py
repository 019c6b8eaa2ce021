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
# Reads one checked 3-D tensor [n, rows, cols] as n matrices (a mixture's experts), each
# from its own blocks: never the whole tensor expanded.
ExpertsReader = Callable[[GGUFFile, gguf.ReaderTensor, tuple[int, int, int]], tuple[W, ...]]


@dataclass(frozen=True)
class ExpertWeights(Generic[W]):
    """One layer's mixture of experts (``ModelSpec.experts`` says how it routes).

    Expert ``e``'s FFN is ``down[e] @ act(gate[e] @ h, up[e] @ h)``, biases added where
    the family has them (gpt-oss)."""

    router: W  # [n_experts, d]: the router's logits of a row
    gate_up: tuple[tuple[W, ...], ...]  # per expert: (gate, up) [d_ff, d] each, or one fused
    down: tuple[W, ...]  # per expert: [d, d_ff]
    router_bias: FloatArray | None = None  # [n_experts]
    gate_bias: FloatArray | None = None  # [n_experts, d_ff]
    up_bias: FloatArray | None = None  # [n_experts, d_ff]
    down_bias: FloatArray | None = None  # [n_experts, d]
    selection_bias: FloatArray | None = None  # [n_experts]: added to choose, not to weigh


@dataclass(frozen=True)
class MlaWeights(Generic[W]):
    """One layer's multi-head latent attention (``model/mla.py``): H heads, ``r`` the
    kv latent's width, ``p`` the rotary part's, ``n`` a head's no-rotary part's."""

    q: tuple[W, ...]  # (attn_q [H (n + p), d],) or (attn_q_a [q_rank, d], attn_q_b)
    q_norm: FloatArray | None  # [q_rank]: RMSNorm of the query latent; None with attn_q
    kv_a: W  # [r + p, d]: the latent c and the shared k_pe of a row
    kv_norm: FloatArray  # [r]: RMSNorm of c
    k_b: tuple[W, ...]  # per head [r, n]: a query head's no-rotary part into the latent
    v_b: tuple[W, ...]  # per head [v, r]: the latent's output into a value head


@dataclass(frozen=True)
class LayerWeights(Generic[W]):
    """One transformer block. Matrices are ``[out, in]`` so that ``y = x @ W.T``.

    Optional parts are None where the family has none (``ModelSpec`` says which). The
    feed-forward is the dense one (``gate_up``, ``w_down``), a mixture of experts, or both:
    a mixture's shared expert is the dense part, scaled by ``sigmoid(shared_gate . h)``
    where the family gates it (Qwen2-MoE).
    """

    attn_norm: FloatArray  # [d]
    qkv: tuple[W, ...]  # (wq, wk, wv), or one fused [q | k | v] matrix; q: [H * hd, d]
    wo: W  # [d, H * hd]
    ffn_norm: FloatArray  # [d]
    gate_up: tuple[W, ...]  # (w_gate, w_up) [d_ff, d] each, or one fused [gate | up]; ()
    w_down: W | None  # [d, d_ff]; None where the layer has no dense feed-forward
    qkv_bias: FloatArray | None = None  # [q | k | v] widths
    q_norm: FloatArray | None = None  # [hd], RMSNorm weight of each query head
    k_norm: FloatArray | None = None  # [hd]
    post_attn_norm: FloatArray | None = None  # [d]
    post_ffn_norm: FloatArray | None = None  # [d]
    wo_bias: FloatArray | None = None  # [d]
    sinks: FloatArray | None = None  # [H]: each query head's attention sink logit
    experts: ExpertWeights[W] | None = None
    shared_gate: FloatArray | None = None  # [d]
    mla: MlaWeights[W] | None = None  # latent attention in place of ``qkv`` (then empty)


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


def dequantized_experts(
    f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int, int]
) -> tuple[FloatArray, ...]:
    """A 3-D tensor as float32 matrices, views of one array (the reference backend's)."""
    whole = dequantized(t, shape)
    return tuple(whole[e] for e in range(shape[0]))


def dequantized(
    t: gguf.ReaderTensor, shape: tuple[int, ...], raw: np.ndarray | None = None
) -> FloatArray:
    """A tensor as a read-only float32 array of ``shape``, from its bytes ``raw`` (uint8)
    where given, else through the file's memory map."""
    try:
        values = gguf.quants.dequantize(t.data if raw is None else raw, QT(t.tensor_type))
    except (ValueError, NotImplementedError) as e:
        raise ModelFileError(f"tensor {t.name!r} cannot be dequantized: {e}") from e
    out = np.ascontiguousarray(np.asarray(values, dtype=F32).reshape(shape))
    out.setflags(write=False)
    return out


def load_shard_weights(
    f: GGUFFile,
    spec: ModelSpec,
    layers: LayerRange,
    # The defaults read float32 arrays (W = np.ndarray): a default cannot bind W for mypy.
    matrix: MatrixReader[W] = dequantized_matrix,  # type: ignore[assignment]
    experts: ExpertsReader[W] = dequantized_experts,  # type: ignore[assignment]
) -> ShardWeights[W]:
    """Read the tensors of ``layers`` (and embedding/head at the ends); matrices via
    ``matrix``, a mixture's 3-D expert tensors via ``experts``."""
    layers.check_within(spec.n_layers)
    d, vocab = spec.d_model, spec.vocab_size

    def array(name: str, shape: tuple[int, ...]) -> FloatArray:
        # read off the file, as the matrices are: a page faulted in through the map
        # brings its cached neighbours (the kernel maps ~64 KB around a fault), ~1.6 MB
        # of other tensors' bytes counted again in a MoE node's resident memory
        t = checked_tensor(f, name, shape)
        return dequantized(t, shape, f.read_tensor(t))

    def mat(name: str, shape: tuple[int, int]) -> W:
        return matrix(f, checked_tensor(f, name, shape), shape)

    def stack(name: str, shape: tuple[int, int, int]) -> tuple[W, ...]:
        return experts(f, checked_tensor(f, name, shape), shape)

    def has(name: str) -> bool:
        return name in f.tensors

    parts = _Readers(array, mat, stack, has)
    blocks = tuple(_load_block(parts, spec, i) for i in layers)
    first, last = layers.is_first(), layers.is_last(spec.n_layers)
    embedding = mat("token_embd.weight", (vocab, d)) if first or (last and spec.tied_head) else None
    output_norm = array("output_norm.weight", (d,)) if last else None
    head: W | None = None
    if last:
        head = embedding if spec.tied_head else mat("output.weight", (vocab, d))
    return ShardWeights(layers, blocks, embedding if first else None, output_norm, head)


@dataclass(frozen=True)
class _Readers(Generic[W]):
    """How one file's tensors are read for a shard: checked, each as its kind."""

    array: Callable[[str, tuple[int, ...]], FloatArray]  # a float32 vector or small array
    matrix: Callable[[str, tuple[int, int]], W]
    experts: Callable[[str, tuple[int, int, int]], tuple[W, ...]]
    has: Callable[[str], bool]

    def vector(self, name: str, size: int) -> FloatArray:
        return self.array(name, (size,))

    def optional(self, name: str, shape: tuple[int, ...]) -> FloatArray | None:
        return self.array(name, shape) if self.has(name) else None


def _load_block(r: _Readers[W], spec: ModelSpec, i: int) -> LayerWeights[W]:
    d, hd = spec.d_model, spec.head_dim
    p = f"blk.{i}."
    mla = _load_mla(r, spec, p) if spec.mla is not None else None
    qkv, bias = _load_qkv(r, spec, p) if mla is None else ((), None)
    # attn_output's input: the query heads, or latent attention's value heads
    o_width = spec.q_width if spec.mla is None else spec.n_heads * spec.mla.v_dim
    moe = spec.experts is not None and r.has(p + "ffn_gate_inp.weight")
    gate_up, w_down = (
        _dense_ffn(r, spec, p + "ffn_{}_shexp.weight", _shared_ff(spec))
        if moe
        else _dense_ffn(r, spec, p + "ffn_{}.weight", spec.d_ff, required=True)
    )
    post = spec.post_norms
    return LayerWeights(
        attn_norm=r.vector(p + "attn_norm.weight", d),
        qkv=qkv,
        wo=r.matrix(p + "attn_output.weight", (d, o_width)),
        ffn_norm=r.vector(p + spec.ffn_norm_name + ".weight", d),
        gate_up=gate_up,
        w_down=w_down,
        qkv_bias=bias,
        q_norm=r.vector(p + "attn_q_norm.weight", hd) if spec.qk_norm else None,
        k_norm=r.vector(p + "attn_k_norm.weight", hd) if spec.qk_norm else None,
        post_attn_norm=r.vector(p + "post_attention_norm.weight", d) if post else None,
        post_ffn_norm=r.vector(p + "post_ffw_norm.weight", d) if post else None,
        wo_bias=r.optional(p + "attn_output.bias", (d,)),
        sinks=r.optional(p + "attn_sinks.weight", (spec.n_heads,)),
        experts=_load_experts(r, spec, p) if moe else None,
        shared_gate=r.optional(p + "ffn_gate_inp_shexp.weight", (d,)) if moe else None,
        mla=mla,
    )


def _load_qkv(r: _Readers[W], spec: ModelSpec, p: str) -> tuple[tuple[W, ...], FloatArray | None]:
    """A layer's Q/K/V matrices (three, or one fused) and their biases where it has them."""
    d, kv_width = spec.d_model, spec.kv_width
    widths = (spec.q_width, kv_width, kv_width)
    qkv: tuple[W, ...]
    if spec.fused_qkv:
        qkv = (r.matrix(p + "attn_qkv.weight", (sum(widths), d)),)
    else:
        qkv = tuple(
            r.matrix(p + f"attn_{n}.weight", (w, d)) for n, w in zip("qkv", widths, strict=True)
        )
    if not spec.qkv_bias:
        return qkv, None
    if spec.fused_qkv:
        return qkv, r.vector(p + "attn_qkv.bias", sum(widths))
    parts = [r.vector(p + f"attn_{n}.bias", w) for n, w in zip("qkv", widths, strict=True)]
    bias = np.concatenate(parts)
    bias.setflags(write=False)
    return qkv, bias


def _load_mla(r: _Readers[W], spec: ModelSpec, p: str) -> MlaWeights[W]:
    """A layer's latent attention: its query path (direct or through the query latent),
    the kv latent's projection and norm, and the per-head k_b / v_b of its 3-D tensors."""
    m = spec.mla
    assert m is not None  # the caller checked
    d, heads, q_out = spec.d_model, spec.n_heads, spec.n_heads * m.key_dim
    if m.q_rank:
        q: tuple[W, ...] = (r.matrix(p + "attn_q_a.weight", (m.q_rank, d)),)
        q += (r.matrix(p + "attn_q_b.weight", (q_out, m.q_rank)),)
    else:
        q = (r.matrix(p + "attn_q.weight", (q_out, d)),)
    return MlaWeights(
        q=q,
        q_norm=r.vector(p + "attn_q_a_norm.weight", m.q_rank) if m.q_rank else None,
        kv_a=r.matrix(p + "attn_kv_a_mqa.weight", (m.cache_dim, d)),
        kv_norm=r.vector(p + "attn_kv_a_norm.weight", m.kv_rank),
        k_b=r.experts(p + "attn_k_b.weight", (heads, m.kv_rank, m.nope_dim)),
        v_b=r.experts(p + "attn_v_b.weight", (heads, m.v_dim, m.kv_rank)),
    )


def _shared_ff(spec: ModelSpec) -> int:
    """A mixture's shared experts' width (the dense layers' where the file names none)."""
    return spec.experts.shared_d_ff if spec.experts and spec.experts.shared_d_ff else spec.d_ff


def _dense_ffn(
    r: _Readers[W], spec: ModelSpec, name: str, ff: int, required: bool = False
) -> tuple[tuple[W, ...], W | None]:
    """The dense feed-forward (or a mixture's shared expert) of width ``ff`` named by
    ``name.format(part)``: its gate/up matrices and down matrix; none where it is not
    ``required`` and absent."""
    d = spec.d_model
    if not required and not r.has(name.format("down")):
        return (), None
    if spec.fused_gate_up:
        gate_up: tuple[W, ...] = (r.matrix(name.format("up"), (2 * ff, d)),)
    else:
        gate_up = tuple(r.matrix(name.format(n), (ff, d)) for n in ("gate", "up"))
    return gate_up, r.matrix(name.format("down"), (d, ff))


def _load_experts(r: _Readers[W], spec: ModelSpec, p: str) -> ExpertWeights[W]:
    """A layer's router and experts, from its 3-D ``ffn_*_exps`` tensors (gate and up
    apart, or one ``ffn_gate_up_exps`` of [gate | up] rows)."""
    assert spec.experts is not None  # the caller checked
    d, e, ff = spec.d_model, spec.experts.n_experts, spec.experts.d_ff
    biased = spec.experts.selection_bias
    if r.has(p + "ffn_gate_up_exps.weight"):
        fused = r.experts(p + "ffn_gate_up_exps.weight", (e, 2 * ff, d))
        gate_up: tuple[tuple[W, ...], ...] = tuple((m,) for m in fused)
    else:
        gates = r.experts(p + "ffn_gate_exps.weight", (e, ff, d))
        ups = r.experts(p + "ffn_up_exps.weight", (e, ff, d))
        gate_up = tuple(zip(gates, ups, strict=True))
    return ExpertWeights(
        router=r.matrix(p + "ffn_gate_inp.weight", (e, d)),
        gate_up=gate_up,
        down=r.experts(p + "ffn_down_exps.weight", (e, d, ff)),
        router_bias=r.optional(p + "ffn_gate_inp.bias", (e,)),
        gate_bias=r.optional(p + "ffn_gate_exps.bias", (e, ff)),
        up_bias=r.optional(p + "ffn_up_exps.bias", (e, ff)),
        down_bias=r.optional(p + "ffn_down_exps.bias", (e, d)),
        selection_bias=r.optional(p + "exp_probs_b.bias", (e,)) if biased else None,
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
