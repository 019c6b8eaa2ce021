"""The memory-bandwidth ceiling of batch-1 decode, measured in the same run.

A batch-1 decode step reads every weight it multiplies once: each layer's
matrices and the output head (the embedding lookup reads one row); in a
mixture-of-experts layer, of the stacked experts only the ones the token is
routed to. On a CPU that read, not the arithmetic, bounds the step: no kernel
on ``threads`` threads decodes faster than their read bandwidth over the bytes
a step reads. The bandwidth is the streaming read of a buffer far larger than
the caches (numpy's vectorised reduction, which releases the GIL: ``threads``
Python threads each read their own part at once), the best of a few passes; a
split's nodes take turns on a single stream, so one thread's ceiling is also
theirs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

EMBEDDING = "token_embd.weight"
HEAD = "output.weight"
EXPERTS_SUFFIX = "_exps.weight"  # a layer's experts stacked into one tensor (first axis)


def read_gb_s(buffer_mb: int = 256, passes: int = 5, threads: int = 1) -> float:
    """Streaming read bandwidth of ``threads`` threads together, GB/s (best of ``passes``)."""
    words = np.ones((buffer_mb << 20) // 8, dtype=np.uint64)  # every page touched
    parts = np.array_split(words, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, words.nbytes / (time.perf_counter() - t0))
    return best / 1e9


def decode_bytes(tensor_bytes: Mapping[str, int], experts: tuple[int, int] | None = None) -> int:
    """Bytes of weights one batch-1 decode step reads: every tensor, but of the token
    embedding only a row, unless it is the output head too (no ``output.weight``).

    With ``experts`` (used, total) of a mixture-of-experts model, a stacked-experts
    tensor (``*_exps.weight``) counts ``used / total`` of its bytes: each expert is
    one contiguous slice, and a token reads only the slices it is routed to.
    """
    total = 0
    for name, n in tensor_bytes.items():
        if experts is not None and name.endswith(EXPERTS_SUFFIX):
            used, count = experts
            n = n * used // count
        total += n
    if HEAD in tensor_bytes:
        total -= tensor_bytes.get(EMBEDDING, 0)
    return total


def ceiling_tok_s(gb_s: float, step_bytes: int) -> float:
    """The fastest batch-1 decode that reading ``step_bytes`` a step at ``gb_s`` allows."""
    return gb_s * 1e9 / step_bytes
