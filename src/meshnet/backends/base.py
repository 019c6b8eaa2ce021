"""The interface every compute backend implements for one shard.

A forward step is a *batch*: the new tokens of several sequences laid end to
end as rows of one ``[T, d]`` matrix (sequence 0's rows first), with one
``BatchEntry`` per sequence saying how many rows are its own and which KV
cache they extend. Prefill (many rows) and decode (one row) mix freely in one
batch. Backends own the math and the KV tensor layout; callers own which
sequences run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from meshnet.kv.cache import SequenceKV


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's part of a batched step."""

    kv: SequenceKV  # this shard's cache of the sequence; positions start at kv.length
    n_new: int  # rows of the batch that belong to it


class Backend(Protocol):
    """Math of one layer range. Called from one thread at a time (the shard's owner)."""

    name: str

    def new_kv(self) -> SequenceKV:
        """An empty cache for a new sequence, shaped for this shard's layers."""
        ...

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] to embeddings [T, d]. First shard only."""
        ...

    def run_layers(self, hidden: np.ndarray, batch: Sequence[BatchEntry]) -> np.ndarray:
        """Run this shard's blocks over hidden [T, d]; extend and advance each KV."""
        ...

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm and output head: hidden [N, d] to logits [N, vocab]. Last shard only."""
        ...
