"""The fast CPU backend: matmuls straight from the GGUF's quantized blocks.

Float32 arithmetic throughout, like the reference, but every row goes through
fixed-order code whatever else is in the batch, so a sequence's logits are
bit-identical whether it runs alone or among 31 others (``docs/kernels.md``).
Where the extension is built, every row (prompt or decode) runs each block in
one native call (``native_blocks``), so how a prompt is chunked changes nothing
either. Without it, rows take ``model.block`` with the row kernels of ``quant``
(every row alike) and numba's attention (``attention_numba``). Q/K/V and gate/up
are fused into one matrix each where their blocks share a type; rotary tables are
computed once a position (`rope.RopeTables`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry, HeadSplit, attend_each, finish_step, start_step
from meshnet.backends.kernel_threads import kernel_threads
from meshnet.backends.native_blocks import NativeBlocks, Tables
from meshnet.backends.quant import QuantMatrix
from meshnet.errors import MeshnetError, ModelError, ShardMismatch, UnsupportedTensorType
from meshnet.kv.cache import SequenceKV
from meshnet.layer_range import LayerRange
from meshnet.model.block import forward_block
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.layers import rms_norm, soft_cap
from meshnet.model.rope import RopeTables
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import LayerWeights, ShardWeights, load_shard_weights

F32 = np.float32


class FastBackend:
    """Runs one shard's blocks: native blocks for every row where built, else the row
    kernels through the Python block."""

    name = "fast"
    decodes_rows_exactly = True  # every row goes through the row-wise quantized kernels
    kv_dtype: type[np.floating] = np.float32  # what the KV cache holds

    def __init__(self, spec: ModelSpec, weights: ShardWeights[QuantMatrix]) -> None:
        self.spec = spec
        self.weights = replace(weights, blocks=tuple(_fuse(b) for b in weights.blocks))
        start = weights.layers.start
        ropes = [spec.layer_rope(start + i) for i in range(len(weights.blocks))]
        tables = {r: RopeTables(r) for r in set(ropes)}
        self._tables = [tables[r] for r in ropes]  # per block
        self._native = NativeBlocks.of(spec, start, self.weights.blocks)
        self.runs_native_blocks = self._native is not None  # every row: one native call per block
        if self.kv_dtype != np.float32 and (quant.NATIVE is None or spec.head_dim % 8):
            raise ModelError(
                f"backend {self.name!r} needs the native attention (built, heads a multiple of 8)"
            )

    def new_kv(self) -> SequenceKV:
        """A sequence's cache: windowed layers keep only their window, as rings where the
        native kernel reads them, and a cached prefix's pages are read in place where it
        reads them (kv/pages.py)."""
        start = self.weights.layers.start
        windows = [self.spec.layer_window(start + i) for i in range(len(self.weights.layers))]
        native = quant.NATIVE is not None and self.spec.head_dim % 8 == 0
        n_kv, hd = self.spec.n_kv_heads, self.spec.head_dim
        return SequenceKV(
            len(windows), n_kv, hd, self.kv_dtype, windows=windows, rings=native, paging=native
        )

    def embed(self, ids: np.ndarray) -> np.ndarray:
        if self.weights.embedding is None:
            raise MeshnetError(f"shard {self.weights.layers} has no token embedding")
        rows = quant.dequantize_rows(self.weights.embedding, ids)  # [T, d]
        return rows * F32(self.spec.embed_scale) if self.spec.embed_scale != 1 else rows

    def head(self, hidden: np.ndarray, split: HeadSplit | None = None) -> np.ndarray:
        w = self.weights
        if w.head is None or w.output_norm is None:
            raise MeshnetError(f"shard {w.layers} has no output head")
        # numpy's row reductions do not depend on the other rows: a row's logits are its own
        normed = rms_norm(hidden, w.output_norm, self.spec.rms_eps)
        logits = quant.matmul(normed, w.head) if split is None else split.logits(normed, w.head)
        return soft_cap(logits, self.spec.final_softcap)

    def head_part(self, normed: np.ndarray, stop: int) -> np.ndarray:
        """Normed rows [N, d] times the head's rows ``[0, stop)``: what a ring's last hop
        asks of its first (node/head_assist.py), whose tied head is its embedding.
        ``ShardMismatch`` where this shard holds no head; ``ValueError`` for a ``stop``
        off the head's rows or row groups."""
        w = self.weights
        head = w.head if w.head is not None else w.embedding if self.spec.tied_head else None
        if head is None:
            raise ShardMismatch(f"shard {w.layers} holds no output head")
        if normed.shape[1] != head.cols:
            raise ValueError(f"rows of width {normed.shape[1]} for a head of {head.cols}")
        return quant.matmul(normed, quant.row_range(head, 0, stop))

    def run_layers(self, hidden: np.ndarray, batch: Sequence[BatchEntry]) -> np.ndarray:
        positions = start_step(hidden, batch, self.spec.context_length)  # [T]
        x = np.array(hidden, dtype=F32, copy=True)  # [T, d]
        distinct = {id(t): t for t in self._tables}  # layers share a rope's tables
        at = {key: t.at(positions) for key, t in distinct.items()}  # each looked up once
        tables: list[Tables] = [at[id(t)] for t in self._tables]
        if self._native is None:
            x = self._layers(x, tables, batch)
        else:  # every row, prompt or decode, one native call per block
            self._native.run(x, batch, tables)
        finish_step(batch)
        return x

    def _layers(
        self, x: np.ndarray, tables: list[Tables], batch: Sequence[BatchEntry]
    ) -> np.ndarray:
        s = self.spec
        for i, block in enumerate(self.weights.blocks):
            window = s.layer_window(self.weights.layers.start + i)
            attend = partial(_attend_batch, s, window, i, batch, sinks=block.sinks)
            x = forward_block(s, block, x, *tables[i], _matmul, attend)
        return x


def load_fast_weights(
    f: GGUFFile, spec: ModelSpec, layers: LayerRange
) -> ShardWeights[QuantMatrix]:
    return load_shard_weights(f, spec, layers, quant.from_gguf, expert_matrices)


def expert_matrices(
    f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int, int], q8: bool = False
) -> tuple[QuantMatrix, ...]:
    """A 3-D expert tensor [n, rows, cols] as n matrices, each made from its own blocks
    (an expert's rows are contiguous in the file), the tensor read off the file once."""
    try:
        qtype = QT(t.tensor_type)
    except ValueError as e:
        raise UnsupportedTensorType(f"tensor {t.name!r} has an unknown type") from e
    n, rows, cols = shape
    raw = f.read_tensor(t).reshape(n, -1)  # [n, bytes of one expert]
    return tuple(
        quant.from_blocks(raw[e], qtype, (rows, cols), name=f"{t.name}[{e}]", q8=q8)
        for e in range(n)
    )


def _fuse(w: LayerWeights[QuantMatrix]) -> LayerWeights[QuantMatrix]:
    """The block with Q/K/V and gate/up each one matrix where their block types agree (one
    multiplication instead of several; each expert's too); the parts are then dropped. A
    mixture's experts share one run of pages per kind of matrix (``quant.share_pages``)."""

    def fused(parts: tuple[QuantMatrix, ...]) -> tuple[QuantMatrix, ...]:
        if len(parts) <= 1:
            return parts
        try:
            return (quant.stack_rows(list(parts)),)
        except ValueError:  # mixed block types (a Q4_K_M file's Q4_K q/k and Q6_K v)
            return parts

    experts = w.experts
    if experts is not None:  # each expert's gate/up fused, then all in one run of pages
        gate_up = [fused(e) for e in experts.gate_up]
        widths = {len(parts) for parts in gate_up}
        if len(widths) == 1:
            n = widths.pop()
            flat = quant.share_pages(tuple(m for parts in gate_up for m in parts))
            gate_up = [flat[i : i + n] for i in range(0, len(flat), n)]
        experts = replace(experts, gate_up=tuple(gate_up), down=quant.share_pages(experts.down))
    return replace(w, qkv=fused(w.qkv), gate_up=fused(w.gate_up), experts=experts)


def _matmul(x: np.ndarray, w: QuantMatrix) -> np.ndarray:
    return quant.matmul(x, w)


def _attend_batch(
    spec: ModelSpec,
    window: int,
    layer: int,
    batch: Sequence[BatchEntry],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Store the batch's new keys/values and attend each sequence's rows; [T, H*hd].

    Every row, prompt or decode, through one call of the native kernel where it is
    built; else each sequence's rows through the numba kernel, row by row. ``sinks``
    [H]: the layer's attention sinks (``causal_attention``), or None.
    """
    q = np.ascontiguousarray(q, dtype=F32)
    k = np.ascontiguousarray(k, dtype=F32)
    if sinks is not None:
        sinks = np.ascontiguousarray(sinks, dtype=F32)
    native = quant.NATIVE
    scale, cap = spec.attn_scale, spec.attn_softcap
    if native is None or spec.head_dim % 8:  # the native kernel reads heads 8 lanes at a time
        one = partial(_attention, scale=scale, softcap=cap, window=window, sinks=sinks)
        return attend_each(layer, batch, q, k, v, one)
    t, n_heads, hd = q.shape
    out = np.empty((t, n_heads * hd), dtype=F32)
    entries: list[tuple[np.ndarray, np.ndarray, int, int, int, int, np.ndarray | None]] = []
    row = 0
    for e in batch:
        entries.append(e.kv.entry(layer, e.n_new, row))
        row += e.n_new
    threads = kernel_threads()
    n_kv = k.shape[1]
    native.attend(q, k, v, out, entries, t, n_heads, n_kv, hd, threads, scale, cap, window, sinks)
    return out


def _attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    first_pos: int,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    if sinks is not None:
        sinks = np.ascontiguousarray(sinks, dtype=F32)
    q = np.ascontiguousarray(q)
    from meshnet.backends.attention_numba import attend  # numba loads with the first call

    attend(q, keys, values, first_pos, F32(scale), F32(softcap), window, sinks, out)
    return out
