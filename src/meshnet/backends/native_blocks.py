"""A batch's rows through the native kernels, one call per transformer block.

A decode step multiplies little per call, so Python's price for the dozen calls of
a block (norms, projections, rotary, attention, SwiGLU, residuals) was a third of
it. Here each block is one native call over every row of the batch, prompt
chunks and decode rows alike, with each sequence's cache of that layer. Every row
takes this path wherever it runs (alone, batched, chunked or replayed), so the
bit-identity contracts hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry
from meshnet.backends.quant import QuantMatrix
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import LayerWeights

Handle = object  # an opaque capsule holding one block's weights


class NativeBlocks:
    """Handles on a shard's blocks for the native path."""

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    @staticmethod
    def of(
        spec: ModelSpec,
        blocks: Sequence[LayerWeights[QuantMatrix]],
        fused: Sequence[tuple[QuantMatrix | None, QuantMatrix | None]],
    ) -> NativeBlocks | None:
        """Handles for every block, or None where the kernels are not built or a block
        is not in the layouts they read (then every row takes the other path)."""
        native = quant.NATIVE
        if native is None or not blocks:
            return None
        handles: list[Handle] = []
        for w, (qkv, gate_up) in zip(blocks, fused, strict=True):
            mats = (qkv, w.wo, gate_up, w.w_down)
            if any(m is None or m.kind == "f32" for m in mats):
                return None
            try:
                handle = native.block(
                    *(quant.native_args(m) for m in mats if m is not None),
                    np.ascontiguousarray(w.attn_norm, dtype=np.float32),
                    np.ascontiguousarray(w.ffn_norm, dtype=np.float32),
                    spec.rms_eps,
                    spec.n_heads,
                    spec.n_kv_heads,
                    spec.head_dim,
                    spec.d_model,
                    spec.d_ff,
                    spec.rope_dim // 2,
                )
            except ValueError:  # a shape the kernels do not take (heads, widths)
                return None
            handles.append(handle)
        return NativeBlocks(handles)

    def run(
        self, x: np.ndarray, batch: Sequence[BatchEntry], cos: np.ndarray, sin: np.ndarray
    ) -> None:
        """Every block over x [T, d] (in place), cos/sin [T, rope_dim/2]."""
        native = quant.NATIVE
        assert native is not None  # handles exist only where it is built
        threads = numba.get_num_threads()
        for layer, handle in enumerate(self._handles):
            entries = []
            row = 0
            for e in batch:
                keys, values = e.kv.buffers(layer)
                entries.append((keys, values, e.kv.length, e.n_new, row))
                row += e.n_new
            native.run_block(handle, x, cos, sin, entries, threads)
