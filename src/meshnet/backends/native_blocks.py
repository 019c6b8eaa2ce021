"""A batch's rows through the native kernels, one call per transformer block.

A decode step multiplies little per call, so Python's price for the dozen calls of
a block (norms, projections, rotary, attention, gating, residuals) was a third of
it. Here each block is one native call over every row of the batch, prompt
chunks and decode rows alike, with each sequence's cache of that layer. Every row
takes this path wherever it runs (alone, batched, chunked or replayed), so the
bit-identity contracts hold. The family's traits (``ModelSpec``) travel with each
block's handle.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry
from meshnet.backends.kernel_threads import kernel_threads
from meshnet.backends.quant import QuantMatrix
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import ExpertWeights, LayerWeights

Handle = object  # an opaque capsule holding one block's weights
Tables = tuple[np.ndarray, np.ndarray]  # cos, sin [T, rope pairs] of the step's rows


class NativeBlocks:
    """Handles on a shard's blocks for the native path."""

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    @staticmethod
    def of(
        spec: ModelSpec, first_layer: int, blocks: Sequence[LayerWeights[QuantMatrix]]
    ) -> NativeBlocks | None:
        """Handles for every block, or None where the kernels are not built or a shape is
        one they do not take (then every row takes the Python block path)."""
        if quant.NATIVE is None or not blocks:
            return None
        handles: list[Handle] = []
        for i, w in enumerate(blocks):
            try:
                handles.append(_handle(spec, first_layer + i, w))
            except ValueError:  # a shape the kernels do not take (heads, widths, types)
                return None
        return NativeBlocks(handles)

    def run(self, x: np.ndarray, batch: Sequence[BatchEntry], tables: Sequence[Tables]) -> None:
        """Every block over x [T, d] (in place); ``tables[i]`` are block i's rotary tables."""
        native = quant.NATIVE
        assert native is not None  # handles exist only where it is built
        threads = kernel_threads()
        try:
            for layer, handle in enumerate(self._handles):
                entries = []
                row = 0
                for e in batch:
                    entries.append(e.kv.entry(layer, e.n_new, row))
                    row += e.n_new
                cos, sin = tables[layer]
                native.run_block(handle, x, cos, sin, entries, threads, True, True)  # wide, keep
        finally:  # a long chunk's scratch is faulted in once a forward, not once a block
            native.release_scratch()


# The native kernels' activation codes (native.h ACT_*).
_ACTIVATIONS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}


def _handle(spec: ModelSpec, layer: int, w: LayerWeights[QuantMatrix]) -> Handle:
    """``ValueError`` for a block the kernels do not run: latent attention (DeepSeek's)
    and routers beyond softmax / softmax-over-the-chosen, unscaled, ungrouped, unbiased
    take the Python block, exact through the same row kernels."""
    native = quant.NATIVE
    assert native is not None
    if w.mla is not None:
        raise ValueError("the native block has no latent attention")
    if w.experts is not None and not _native_router(spec, w.experts):
        raise ValueError("the native block has no such router")
    vectors = (
        w.attn_norm,
        w.ffn_norm,
        w.qkv_bias,
        w.q_norm,
        w.k_norm,
        w.post_attn_norm,
        w.post_ffn_norm,
        w.wo_bias,
        w.sinks,
        w.shared_gate,
    )
    traits = (
        spec.rope.style == "halves",
        _ACTIVATIONS[spec.ffn_activation],
        spec.attn_scale,
        spec.attn_softcap,
        spec.layer_window(layer),
    )
    return native.block(
        _matrices(w.qkv),
        quant.native_args(w.wo),
        _matrices(w.gate_up),
        None if w.w_down is None else quant.native_args(w.w_down),
        tuple(_floats(v) for v in vectors),
        spec.rms_eps,
        spec.n_heads,
        spec.n_kv_heads,
        spec.head_dim,
        spec.d_model,
        spec.d_ff,
        spec.layer_rope(layer).pairs,
        traits,
        None if w.experts is None else _experts(spec, w.experts),
    )


def _experts(spec: ModelSpec, w: ExpertWeights[QuantMatrix]) -> Handle:
    """A handle on a layer's mixture of experts, for its block's handle to hold."""
    native = quant.NATIVE
    experts = spec.experts
    assert native is not None and experts is not None
    return native.experts(
        quant.native_args(w.router),
        _floats(w.router_bias),
        tuple(_matrices(parts) for parts in w.gate_up),
        tuple(quant.native_args(m) for m in w.down),
        (_floats(w.gate_bias), _floats(w.up_bias), _floats(w.down_bias)),
        spec.d_model,
        experts.d_ff,
        experts.n_used,
        0 if experts.gating == "softmax" else 1,
        experts.normalize,
        _ACTIVATIONS[spec.ffn_activation],
    )


def _native_router(spec: ModelSpec, w: ExpertWeights[QuantMatrix]) -> bool:
    """Whether native/moe.c routes as ``spec`` says: its two gatings, nothing more."""
    e = spec.experts
    return (
        e is not None
        and e.gating in ("softmax", "softmax_chosen")
        and e.scale == 1.0
        and not e.grouped
        and w.selection_bias is None
    )


def _floats(v: np.ndarray | None) -> np.ndarray | None:
    return None if v is None else np.ascontiguousarray(v, dtype=np.float32)


def _matrices(parts: tuple[QuantMatrix, ...]) -> tuple[tuple[np.ndarray, int, int, int], ...]:
    return tuple(quant.native_args(p) for p in parts)
