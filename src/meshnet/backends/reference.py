"""The numpy reference backend: float32 weights, plain matmuls, exact and slow.

Every faster backend is checked against this one (same greedy tokens, logits
within a stated tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.backends.base import BatchEntry, attend_each, finish_step, start_step
from meshnet.errors import MeshnetError
from meshnet.kv.cache import SequenceKV
from meshnet.model.layers import causal_attention, rms_norm, rope, rope_inv_freq, swiglu_ffn
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import LayerWeights, ShardWeights


class ReferenceBackend:
    """Runs one shard's blocks in numpy float32."""

    name = "numpy"
    decodes_rows_exactly = False  # BLAS may sum a row differently inside a bigger matrix

    def __init__(self, spec: ModelSpec, weights: ShardWeights) -> None:
        self.spec = spec
        self.weights = weights
        self._inv_freq = rope_inv_freq(spec.rope_dim, spec.rope_base)

    def new_kv(self) -> SequenceKV:
        return SequenceKV(len(self.weights.layers), self.spec.n_kv_heads, self.spec.head_dim)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        if self.weights.embedding is None:
            raise MeshnetError(f"shard {self.weights.layers} has no token embedding")
        return self.weights.embedding[ids]  # [T, d]

    def run_layers(self, hidden: np.ndarray, batch: Sequence[BatchEntry]) -> np.ndarray:
        positions = start_step(hidden, batch, self.spec.context_length)  # [T]
        x = hidden.astype(np.float32, copy=True)  # [T, d]
        for i, block in enumerate(self.weights.blocks):
            x = self._block(i, block, x, positions, batch)
        finish_step(batch)
        return x

    def head(self, hidden: np.ndarray) -> np.ndarray:
        w = self.weights
        if w.head is None or w.output_norm is None:
            raise MeshnetError(f"shard {w.layers} has no output head")
        return rms_norm(hidden, w.output_norm, self.spec.rms_eps) @ w.head.T  # [N, vocab]

    def _block(
        self,
        layer: int,
        w: LayerWeights,
        x: np.ndarray,
        positions: np.ndarray,
        batch: Sequence[BatchEntry],
    ) -> np.ndarray:
        s = self.spec
        t = x.shape[0]
        h = rms_norm(x, w.attn_norm, s.rms_eps)  # [T, d]
        q = (h @ w.wq.T).reshape(t, s.n_heads, s.head_dim)  # [T, H, hd]
        k = (h @ w.wk.T).reshape(t, s.n_kv_heads, s.head_dim)  # [T, Hkv, hd]
        v = (h @ w.wv.T).reshape(t, s.n_kv_heads, s.head_dim)  # [T, Hkv, hd]
        q = rope(q, positions, self._inv_freq)
        k = rope(k, positions, self._inv_freq)
        attn = attend_each(layer, batch, q, k, v, causal_attention)  # [T, H*hd]
        x = x + attn @ w.wo.T  # [T, d]
        h = rms_norm(x, w.ffn_norm, s.rms_eps)
        return x + swiglu_ffn(h, w.w_gate, w.w_up, w.w_down)  # [T, d]
