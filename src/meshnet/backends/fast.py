"""The fast CPU backend: matmuls straight from the GGUF's quantized blocks.

Float32 arithmetic throughout, like the reference, but every row goes through
fixed-order code whatever else is in the batch, so a sequence's logits are
bit-identical whether it runs alone or among 31 others (``docs/kernels.md``).
Where the extension is built, every row (prompt or decode) runs each block in
one native call (``native_blocks``), so how a prompt is chunked changes nothing
either. Without it, rows take the block code here: decode rows the numba
kernels in ``quant``, prompt chunks BLAS on dequantized weights, on their own
rows only. Q/K/V and gate/up are fused into one matmul each when their blocks
share a layout; rotary tables are computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry, attend_each, finish_step, start_step
from meshnet.backends.native_blocks import NativeBlocks
from meshnet.backends.quant import QuantMatrix
from meshnet.errors import MeshnetError
from meshnet.kv.cache import SequenceKV
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.layers import rope_inv_freq
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import LayerWeights, ShardWeights, load_shard_weights

F32 = np.float32


@dataclass(frozen=True)
class _Rows:
    """How the block code here multiplies a batch's rows (the path without the native
    blocks): decode rows (one-row entries, and every row of an entry marked
    ``decoded``) through the quantized kernel, each
    prompt chunk (an entry of several rows) on its own through BLAS on dequantized
    weights. Either way a sequence's rows meet the same arithmetic whatever else is in
    the batch."""

    decode: np.ndarray  # row indices of single-row entries
    prompts: tuple[tuple[int, int], ...]  # (first row, rows) of each multi-row entry

    @staticmethod
    def of(batch: Sequence[BatchEntry]) -> _Rows:
        decode: list[int] = []
        prompts: list[tuple[int, int]] = []
        row = 0
        for e in batch:
            if e.n_new == 1 or e.decoded:
                decode.extend(range(row, row + e.n_new))
            else:
                prompts.append((row, e.n_new))
            row += e.n_new
        return _Rows(np.asarray(decode, dtype=np.int64), tuple(prompts))

    def matmul(self, x: np.ndarray, w: QuantMatrix, dense: _DenseCache) -> np.ndarray:
        """``x @ w.T`` for x [T, cols]."""
        if not self.prompts:
            return quant.matmul(x, w)
        out = np.empty((x.shape[0], w.rows), dtype=F32)
        if self.decode.size:
            out[self.decode] = quant.matmul(x[self.decode], w)
        weights = dense.get(w)  # [rows, cols]
        for start, n in self.prompts:
            out[start : start + n] = x[start : start + n] @ weights.T
        return out


class _DenseCache:
    """Float32 copies of the matrices, made the first time a prompt chunk needs each.

    Prefill then pays for dequantizing a matrix once per process instead of once
    per forward; decode never touches these copies.
    """

    def __init__(self) -> None:
        self._dense: dict[int, np.ndarray] = {}

    def get(self, w: QuantMatrix) -> np.ndarray:
        dense = self._dense.get(id(w))
        if dense is None:
            dense = quant.dequantize_all(w)
            self._dense[id(w)] = dense
        return dense


@dataclass(frozen=True)
class _Fused:
    """One block's projections, fused where the layouts allow."""

    qkv: QuantMatrix | None  # [q | k | v] rows when fusable
    gate_up: QuantMatrix | None  # [gate | up] rows when fusable


class FastBackend:
    """Runs one shard's blocks: native blocks for every row where built, else numba
    kernels for decode rows and BLAS for prompt chunks."""

    name = "fast"
    decodes_rows_exactly = True  # decode rows go through the row-wise quantized kernel

    def __init__(self, spec: ModelSpec, weights: ShardWeights[QuantMatrix]) -> None:
        self.spec = spec
        self.weights = weights
        self._fused = [_fuse(b) for b in weights.blocks]
        self._dense = _DenseCache()  # keyed by matrix identity: the matrices live as long
        angles = (
            np.arange(spec.context_length, dtype=F32)[:, None]
            * rope_inv_freq(spec.rope_dim, spec.rope_base)[None, :]
        )
        self._cos = np.cos(angles)  # [ctx, rope_dim / 2], computed once for every position
        self._sin = np.sin(angles)
        self._native = NativeBlocks.of(
            spec, weights.blocks, [(f.qkv, f.gate_up) for f in self._fused]
        )
        self.runs_native_blocks = self._native is not None  # every row: one native call per block

    def new_kv(self) -> SequenceKV:
        return SequenceKV(len(self.weights.layers), self.spec.n_kv_heads, self.spec.head_dim)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        if self.weights.embedding is None:
            raise MeshnetError(f"shard {self.weights.layers} has no token embedding")
        return quant.dequantize_rows(self.weights.embedding, ids)  # [T, d]

    def head(self, hidden: np.ndarray) -> np.ndarray:
        w = self.weights
        if w.head is None or w.output_norm is None:
            raise MeshnetError(f"shard {w.layers} has no output head")
        return quant.matmul(_rms_norm(hidden, w.output_norm, self.spec.rms_eps), w.head)

    def run_layers(self, hidden: np.ndarray, batch: Sequence[BatchEntry]) -> np.ndarray:
        positions = start_step(hidden, batch, self.spec.context_length)  # [T]
        x = np.array(hidden, dtype=F32, copy=True)  # [T, d]
        cos, sin = self._cos[positions], self._sin[positions]  # [T, rope_dim / 2]
        if self._native is None:
            x = self._layers(x, cos, sin, batch)
        else:  # every row, prompt or decode, one native call per block
            self._native.run(x, batch, cos, sin)
        finish_step(batch)
        return x

    def _layers(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, batch: Sequence[BatchEntry]
    ) -> np.ndarray:
        rows = _Rows.of(batch)
        for i, block in enumerate(self.weights.blocks):
            x = self._block(i, block, self._fused[i], x, cos, sin, batch, rows)
        return x

    def _block(
        self,
        layer: int,
        w: LayerWeights[QuantMatrix],
        fused: _Fused,
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        batch: Sequence[BatchEntry],
        rows: _Rows,
    ) -> np.ndarray:
        s = self.spec
        t = x.shape[0]
        q_width = s.n_heads * s.head_dim
        h = _rms_norm(x, w.attn_norm, s.rms_eps)  # [T, d]
        if fused.qkv is not None:
            qkv = rows.matmul(h, fused.qkv, self._dense)  # [T, q + 2 kv]
            q, k, v = np.split(qkv, [q_width, q_width + s.kv_width], axis=1)
        else:
            q, k, v = (rows.matmul(h, m, self._dense) for m in (w.wq, w.wk, w.wv))
        q = _rope(q.reshape(t, s.n_heads, s.head_dim), cos, sin)  # [T, H, hd]
        k = _rope(k.reshape(t, s.n_kv_heads, s.head_dim), cos, sin)  # [T, Hkv, hd]
        v = np.ascontiguousarray(v).reshape(t, s.n_kv_heads, s.head_dim)
        attn = _attend_batch(layer, batch, q, k, v)  # [T, H*hd]
        x = x + rows.matmul(attn, w.wo, self._dense)
        h = _rms_norm(x, w.ffn_norm, s.rms_eps)
        if fused.gate_up is not None:
            gate_up = rows.matmul(h, fused.gate_up, self._dense)  # [T, 2 d_ff]
        else:
            gate = rows.matmul(h, w.w_gate, self._dense)
            gate_up = np.concatenate([gate, rows.matmul(h, w.w_up, self._dense)], axis=1)
        return x + rows.matmul(_swiglu(gate_up, s.d_ff), w.w_down, self._dense)


def load_fast_weights(
    f: GGUFFile, spec: ModelSpec, layers: LayerRange
) -> ShardWeights[QuantMatrix]:
    return load_shard_weights(f, spec, layers, quant.from_gguf)


def set_threads(n: int) -> None:
    """Threads the kernels use in this process (one pool per process)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def _fuse(w: LayerWeights[QuantMatrix]) -> _Fused:
    def maybe(parts: list[QuantMatrix]) -> QuantMatrix | None:
        try:
            return quant.stack_rows(parts)
        except ValueError:
            return None

    return _Fused(maybe([w.wq, w.wk, w.wv]), maybe([w.w_gate, w.w_up]))


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Adjacent-pair rotary embedding with precomputed tables; x [T, heads, hd]."""
    native = quant.NATIVE
    if native is not None:  # the same arithmetic (no fused multiply-add), in one pass
        out = np.array(x, dtype=F32, copy=True, order="C")
        t, heads, hd = out.shape
        native.rope(out, cos, sin, t, heads, hd, cos.shape[1])
        return out
    n = 2 * cos.shape[1]
    c, s_ = cos[:, None, :], sin[:, None, :]
    even, odd = x[..., 0:n:2], x[..., 1:n:2]
    out = np.array(x, dtype=F32, copy=True)
    out[..., 0:n:2] = even * c - odd * s_
    out[..., 1:n:2] = even * s_ + odd * c
    return out


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x, dtype=F32)
    _rms_norm_rows(np.ascontiguousarray(x, dtype=F32), weight, F32(eps), out)
    return out


def _swiglu(gate_up: np.ndarray, d_ff: int) -> np.ndarray:
    """silu(gate) * up for gate_up [T, 2 d_ff] = [gate | up]; [T, d_ff]."""
    gate_up = np.ascontiguousarray(gate_up, dtype=F32)
    out = np.empty((gate_up.shape[0], d_ff), dtype=F32)
    native = quant.NATIVE
    if native is not None:  # on this thread: idle OpenMP workers would spin against BLAS
        native.swiglu(gate_up, out, gate_up.shape[0], d_ff, 1)
    else:
        gate, up = gate_up[:, :d_ff], gate_up[:, d_ff:]
        _swiglu_rows(np.ascontiguousarray(gate), np.ascontiguousarray(up), out)
    return out


@numba.njit(fastmath=True, cache=True)
def _rms_norm_rows(x: np.ndarray, w: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    d = x.shape[1]
    acc = np.empty(32, np.float32)
    for t in range(x.shape[0]):
        acc[:] = 0.0
        for c in range(0, d - d % 32, 32):
            for i in range(32):
                acc[i] += x[t, c + i] * x[t, c + i]
        ss = np.float32(0.0)
        for i in range(32):
            ss += acc[i]
        for c in range(d - d % 32, d):
            ss += x[t, c] * x[t, c]
        scale = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for c in range(d):
            out[t, c] = (x[t, c] * scale) * w[c]


@numba.njit(fastmath=True, cache=True)
def _swiglu_rows(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    for t in range(gate.shape[0]):
        for c in range(gate.shape[1]):
            g = gate[t, c]
            out[t, c] = g / (np.float32(1.0) + np.exp(-g)) * up[t, c]


def _attend_batch(
    layer: int, batch: Sequence[BatchEntry], q: np.ndarray, k: np.ndarray, v: np.ndarray
) -> np.ndarray:
    """Store the batch's new keys/values and attend each sequence's rows; [T, H*hd].

    Prompt chunks go through BLAS one by one; every decode row (one-row entries and
    rows marked ``decoded``) through one call of the native kernel where it is built.
    """
    native = quant.NATIVE
    if native is None:
        return attend_each(layer, batch, q, k, v, _attention, _prompt_attention)
    t, n_heads, hd = q.shape
    out = np.empty((t, n_heads * hd), dtype=F32)
    decode: list[tuple[np.ndarray, np.ndarray, int, int, int]] = []
    row = 0
    for e in batch:
        if e.n_new > 1 and not e.decoded:
            mine = slice(row, row + e.n_new)
            e.kv.write(layer, k[mine].transpose(1, 0, 2), v[mine].transpose(1, 0, 2))
            keys, values = e.kv.view(layer, e.n_new)
            out[mine] = _prompt_attention(q[mine], keys, values, e.kv.length)
        else:
            keys, values = e.kv.buffers(layer)
            decode.append((keys, values, e.kv.length, e.n_new, row))
        row += e.n_new
    if decode:
        native.attend(q, k, v, out, decode, t, n_heads, k.shape[1], hd, numba.get_num_threads())
    return out


def _prompt_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int
) -> np.ndarray:
    """Causal attention of a prompt chunk through BLAS: one batched matmul pair over the
    KV heads, each KV head's query heads stacked.

    q [n, H, hd] at positions ``first_pos ..``; keys, values [Hkv, L, hd]; [n, H * hd].
    The chunk's rows are only ever computed together, chunked the same way
    whatever else runs, so this is as repeatable as the row kernel decode uses.
    """
    n, n_heads, hd = q.shape
    n_kv, length = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    hidden = np.arange(length)[None, :] > (first_pos + np.arange(n))[:, None]  # [n, L]
    mask = np.where(hidden, F32(-np.inf), F32(0.0))  # adding 0 leaves a score as it is
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd)
    scores = np.matmul(qg, keys.transpose(0, 2, 1)).reshape(n_kv, group, n, length)
    scores *= F32(1.0 / np.sqrt(hd))
    scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    heads = np.matmul(scores.reshape(n_kv, group * n, length), values)  # [Hkv, group*n, hd]
    return heads.reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3).reshape(n, n_heads * hd)


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int) -> np.ndarray:
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    _attend(np.ascontiguousarray(q), keys, values, first_pos, out)
    return out


@numba.njit(fastmath=True, cache=True)
def _attend(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int, out: np.ndarray
) -> None:
    """Causal grouped-query attention of one sequence's new rows (as ``causal_attention``).

    q [n, H, hd] at positions ``first_pos ..``; keys, values [Hkv, L, hd]; out [n, H * hd].
    """
    n, n_heads, hd = q.shape
    group = n_heads // keys.shape[0]
    scale = np.float32(1.0 / np.sqrt(hd))
    scores = np.empty(keys.shape[1], np.float32)
    for i in range(n):
        visible = first_pos + i + 1
        for h in range(n_heads):
            kv = h // group
            top = np.float32(-np.inf)
            for j in range(visible):
                s = np.float32(0.0)
                for c in range(hd):
                    s += q[i, h, c] * keys[kv, j, c]
                s *= scale
                scores[j] = s
                top = max(top, s)
            total = np.float32(0.0)
            for j in range(visible):
                e = np.exp(scores[j] - top)
                scores[j] = e
                total += e
            base = h * hd
            for c in range(hd):
                out[i, base + c] = 0.0
            for j in range(visible):
                p = scores[j] / total
                for c in range(hd):
                    out[i, base + c] += p * values[kv, j, c]
