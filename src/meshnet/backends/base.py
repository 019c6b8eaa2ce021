"""The interface every compute backend implements for one shard.

A forward step is a *batch*: the new tokens of several sequences laid end to
end as rows of one ``[T, d]`` matrix (sequence 0's rows first), with one
``BatchEntry`` per sequence saying how many rows are its own and which KV
cache they extend. Prefill (many rows) and decode (one row) mix freely in one
batch. Backends own the math and the KV tensor layout; callers own which
sequences run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from meshnet.errors import MeshnetError
from meshnet.kv.cache import SequenceKV

if TYPE_CHECKING:
    from meshnet.backends.quant import QuantMatrix

# One sequence's attention: (q [n, H, hd], keys [Hkv, L, hd], values, first position) -> [n, H*hd]
Attention = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's part of a batched step."""

    kv: SequenceKV  # this shard's cache of the sequence; positions start at kv.length
    n_new: int  # rows of the batch that belong to it
    decoded: bool = False  # compute each row exactly as a one-row decode step would


class HeadSplit(Protocol):
    """Multiplies one normed row by a quantized head with another node's help, exactly as
    one ``quant.matmul`` would (node/head_assist.py)."""

    def logits(self, normed: np.ndarray, head: QuantMatrix) -> np.ndarray: ...


class Backend(Protocol):
    """Math of one layer range. Called from one thread at a time (the shard's owner)."""

    name: str
    # True when rows of an entry marked ``decoded`` come out bit-identical to running
    # them as one-row steps; otherwise the engine runs such rows one per forward.
    decodes_rows_exactly: bool

    def new_kv(self) -> SequenceKV:
        """An empty cache for a new sequence, shaped for this shard's layers."""
        ...

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] to embeddings [T, d]. First shard only."""
        ...

    def run_layers(self, hidden: np.ndarray, batch: Sequence[BatchEntry]) -> np.ndarray:
        """Run this shard's blocks over hidden [T, d]; extend and advance each KV."""
        ...

    def head(self, hidden: np.ndarray, split: HeadSplit | None = None) -> np.ndarray:
        """Final norm and output head: hidden [N, d] to logits [N, vocab]. Last shard only.
        ``split``: where the head is quantized, its multiply is shared through it."""
        ...


def start_step(hidden: np.ndarray, batch: Sequence[BatchEntry], context_length: int) -> np.ndarray:
    """Check a batch against its rows and the context, reserve KV room; positions [T]."""
    if hidden.shape[0] != sum(e.n_new for e in batch):
        raise ValueError("batch rows do not match the entries' token counts")
    positions = np.concatenate([np.arange(e.kv.length, e.kv.length + e.n_new) for e in batch])
    if positions.size and positions.max() >= context_length:
        raise MeshnetError(f"position past the context length {context_length}")
    for e in batch:
        e.kv.reserve(e.n_new)
    return positions


def finish_step(batch: Sequence[BatchEntry]) -> None:
    """Commit the positions every layer has written."""
    for e in batch:
        e.kv.advance(e.n_new)


def attend_each(
    layer: int,
    batch: Sequence[BatchEntry],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    attend: Attention,
    attend_prompt: Attention | None = None,
) -> np.ndarray:
    """Store each sequence's new keys/values in its cache and attend over it; [T, H*hd].

    q [T, H, hd]; k, v [T, Hkv, hd]. Sequences never see each other's rows. A
    prompt chunk (several rows, not decode rows sent again) uses ``attend_prompt``
    when given: it only ever meets other prompt chunks of the same shape.
    """
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    row = 0
    for e in batch:
        mine = slice(row, row + e.n_new)
        e.kv.write(layer, k[mine].transpose(1, 0, 2), v[mine].transpose(1, 0, 2))
        keys, values = e.kv.view(layer, e.n_new)
        prompt = attend_prompt is not None and e.n_new > 1 and not e.decoded
        fn = attend_prompt if prompt and attend_prompt is not None else attend
        out[mine] = fn(q[mine], keys, values, e.kv.length)
        row += e.n_new
    return out
