"""The memory-bandwidth ceiling of batch-1 decode, measured in the same run.

A batch-1 decode step reads every weight it multiplies once: each layer's
matrices and the output head (the embedding lookup reads one row). On a CPU
that read, not the arithmetic, bounds the step: no kernel on ``threads``
threads decodes faster than their read bandwidth over the bytes a step reads.
The bandwidth is one thread's streaming read of a buffer far larger than the
caches (numpy's vectorised reduction), the best of a few passes; a split's
nodes take turns on a single stream, so one thread's ceiling is also theirs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

EMBEDDING = "token_embd.weight"
HEAD = "output.weight"


def read_gb_s(buffer_mb: int = 256, passes: int = 5) -> float:
    """One thread's streaming read bandwidth, GB/s (best of ``passes``)."""
    words = np.ones((buffer_mb << 20) // 8, dtype=np.uint64)  # every page touched
    best = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        words.sum()
        best = max(best, words.nbytes / (time.perf_counter() - t0))
    return best / 1e9


def decode_bytes(tensor_bytes: Mapping[str, int]) -> int:
    """Bytes of weights one batch-1 decode step reads: every tensor, but of the token
    embedding only a row, unless it is the output head too (no ``output.weight``)."""
    total = sum(tensor_bytes.values())
    if HEAD in tensor_bytes:
        total -= tensor_bytes.get(EMBEDDING, 0)
    return total


def ceiling_tok_s(gb_s: float, step_bytes: int) -> float:
    """The fastest batch-1 decode that reading ``step_bytes`` a step at ``gb_s`` allows."""
    return gb_s * 1e9 / step_bytes
