"""The numpy reference backend: float32 weights, plain matmuls, exact and slow.

Every faster backend is checked against this one (same greedy tokens, logits
within a stated tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from meshnet.backends.base import BatchEntry, HeadSplit, attend_each, finish_step, start_step
from meshnet.errors import MeshnetError
from meshnet.kv.cache import SequenceKV
from meshnet.model.block import forward_block
from meshnet.model.layers import causal_attention, rms_norm, soft_cap
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import ShardWeights


class ReferenceBackend:
    """Runs one shard's blocks in numpy float32."""

    name = "numpy"
    decodes_rows_exactly = False  # BLAS may sum a row differently inside a bigger matrix

    def __init__(self, spec: ModelSpec, weights: ShardWeights[np.ndarray]) -> None:
        self.spec = spec
        self.weights = weights

    def new_kv(self) -> SequenceKV:
        """A sequence's cache, laid out by position; a windowed layer exports its window."""
        start = self.weights.layers.start
        windows = [self.spec.layer_window(start + i) for i in range(len(self.weights.layers))]
        n_kv, hd = self.spec.n_kv_heads, self.spec.head_dim
        return SequenceKV(len(windows), n_kv, hd, windows=windows)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        if self.weights.embedding is None:
            raise MeshnetError(f"shard {self.weights.layers} has no token embedding")
        rows = self.weights.embedding[ids]  # [T, d]
        return rows * np.float32(self.spec.embed_scale) if self.spec.embed_scale != 1 else rows

    def run_layers(self, hidden: np.ndarray, batch: Sequence[BatchEntry]) -> np.ndarray:
        s = self.spec
        positions = start_step(hidden, batch, s.context_length)  # [T]
        x = hidden.astype(np.float32, copy=True)  # [T, d]
        for i, block in enumerate(self.weights.blocks):
            layer = self.weights.layers.start + i
            cos, sin = s.layer_rope(layer).tables(positions)  # [T, pairs]
            one = partial(
                causal_attention,
                scale=s.attn_scale,
                softcap=s.attn_softcap,
                window=s.layer_window(layer),
                sinks=block.sinks,
            )
            attend = partial(attend_each, i, batch, attend=one)
            x = forward_block(s, block, x, cos, sin, _matmul, attend)
        finish_step(batch)
        return x

    def head(self, hidden: np.ndarray, split: HeadSplit | None = None) -> np.ndarray:
        w = self.weights  # a float32 head: ``split`` (for quantized heads) has no part here
        if w.head is None or w.output_norm is None:
            raise MeshnetError(f"shard {w.layers} has no output head")
        logits = rms_norm(hidden, w.output_norm, self.spec.rms_eps) @ w.head.T  # [N, vocab]
        return soft_cap(logits, self.spec.final_softcap)


def _matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x @ w.T
