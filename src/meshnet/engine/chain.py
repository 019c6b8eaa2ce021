"""Shards chained in one process: the output of one is the input of the next.

This is the in-process form of a route (``meshnet generate --split K``); the
mesh runs the same shards in separate node processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.backends.base import BatchEntry
from meshnet.backends.shard import LogitsMode, Shard
from meshnet.errors import LayerRangeError
from meshnet.kv.cache import SequenceKV
from meshnet.layer_range import covers_exactly

ChainKV = list[SequenceKV]  # one cache per shard of the chain, in chain order


class ShardChain:
    """Shards covering every layer of one model exactly once, in layer order."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        if not shards:
            raise LayerRangeError("a chain needs at least one shard")
        spec = shards[0].spec
        if not covers_exactly([s.layers for s in shards], spec.n_layers):
            ranges = ", ".join(str(s.layers) for s in shards)
            raise LayerRangeError(f"shards {ranges} do not cover [0, {spec.n_layers}) exactly")
        if len({s.fingerprint for s in shards}) != 1:
            raise LayerRangeError("shards of one chain must come from the same model file")
        self.shards = tuple(shards)
        self.spec = spec

    def new_sequence(self) -> ChainKV:
        return [s.backend.new_kv() for s in self.shards]

    def forward(
        self,
        ids: np.ndarray,
        seqs: Sequence[ChainKV],
        n_new: Sequence[int],
        logits: LogitsMode = "last",
    ) -> np.ndarray:
        """Run ids [T] of ``seqs`` (``n_new[i]`` rows each) through every shard; logits out."""
        x = ids
        for i, shard in enumerate(self.shards):
            batch = [BatchEntry(kv[i], n) for kv, n in zip(seqs, n_new, strict=True)]
            x = shard.forward(x, batch, logits)
        return x
