"""The numba attention kernel: a sequence's new rows where the native one does not run.

It serves where the extension is not built, or for heads whose width is not a
multiple of 8 (the native kernel reads heads 8 lanes at a time). Its own module so
that numba is imported only by a process that calls it (``fast._attention``).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(fastmath=True, cache=True)
def attend(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    first_pos: int,
    scale: np.float32,
    softcap: np.float32,
    window: int,
    sinks: np.ndarray | None,
    out: np.ndarray,
) -> None:
    """Causal grouped-query attention of one sequence's new rows (as ``causal_attention``).

    q [n, H, hd] at positions ``first_pos ..``; keys, values [Hkv, L, hd]; sinks [H] or
    None; out [n, H * hd]. A head's sink joins the max, and its term the total after the
    scores' (llama.cpp's order); None compiles to the code without them.
    """
    n, n_heads, hd = q.shape
    group = n_heads // keys.shape[0]
    scores = np.empty(keys.shape[1], np.float32)
    for i in range(n):
        end = first_pos + i + 1
        start = end - window if 0 < window < end else 0
        for h in range(n_heads):
            kv = h // group
            top = np.float32(-np.inf)
            for j in range(start, end):
                s = np.float32(0.0)
                for c in range(hd):
                    s += q[i, h, c] * keys[kv, j, c]
                s *= scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                scores[j] = s
                top = max(top, s)
            if sinks is not None:
                top = max(top, sinks[h])
            total = np.float32(0.0)
            for j in range(start, end):
                e = np.exp(scores[j] - top)
                scores[j] = e
                total += e
            if sinks is not None:
                total += np.exp(sinks[h] - top)
            base = h * hd
            for c in range(hd):
                out[i, base + c] = 0.0
            for j in range(start, end):
                p = scores[j] / total
                for c in range(hd):
                    out[i, base + c] += p * values[kv, j, c]
