"""Multi-head latent attention in numpy, absorbed as llama.cpp runs it (``model/mla.py``).

Shapes: ``T`` rows, ``d`` model width, ``H`` heads, ``n`` a head's no-rotary dims, ``p``
the rotary dims, ``r`` the kv latent's width, ``v`` a value head's width. How a matrix
is multiplied and how a batch's sequences attend are the caller's, as for
``model/block.py``: every operation here is row by row, so a row's result is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from meshnet.model.layers import rms_norm
from meshnet.model.rope import rotate
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import MlaWeights

W = TypeVar("W")
Matmul = Callable[[np.ndarray, W], np.ndarray]  # (x [T, in], W [out, in]) -> [T, out]
Attend = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # as model/block.py's


def latent_attention(
    spec: ModelSpec,
    w: MlaWeights[W],
    h: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    matmul: Matmul[W],
    attend: Attend,
) -> np.ndarray:
    """The value heads [T, H * v] of normed rows h [T, d], for ``attn_output``.

    Every query head attends over the one cached ``[c | k_pe]`` of each position (the
    cache's single kv head, ``r + p`` wide, its values the same array: the output's
    ``k_pe`` part is dropped, so only ``c`` is weighed)."""
    m = spec.mla
    assert m is not None  # a block with latent attention weights has its spec
    t, heads, eps = h.shape[0], spec.n_heads, spec.rms_eps
    q = _queries(w, h, matmul, eps).reshape(t, heads, m.key_dim)  # [T, H, n + p]
    q_pe = rotate(q[..., m.nope_dim :], cos, sin, spec.rope.style)  # [T, H, p]
    q_latent = np.stack(
        [matmul(q[:, i, : m.nope_dim], w.k_b[i]) for i in range(heads)], axis=1
    )  # [T, H, r]: W_kb[h]^T q_nope
    kv = matmul(h, w.kv_a)  # [T, r + p]
    c = rms_norm(kv[:, : m.kv_rank], w.kv_norm, eps)  # [T, r]
    k_pe = rotate(kv[:, None, m.kv_rank :], cos, sin, spec.rope.style)  # [T, 1, p]
    query = np.concatenate([q_latent, q_pe], axis=-1)  # [T, H, r + p]
    key = np.ascontiguousarray(np.concatenate([c[:, None], k_pe], axis=-1))  # [T, 1, r + p]
    out = attend(query, key, key).reshape(t, heads, m.cache_dim)[..., : m.kv_rank]  # [T, H, r]
    return np.concatenate([matmul(out[:, i], w.v_b[i]) for i in range(heads)], axis=1)


def _queries(w: MlaWeights[W], h: np.ndarray, matmul: Matmul[W], eps: float) -> np.ndarray:
    """Every head's query [T, H (n + p)]: attn_q, or attn_q_b of the normed query latent."""
    if w.q_norm is None:
        return matmul(h, w.q[0])
    latent = rms_norm(matmul(h, w.q[0]), w.q_norm, eps)  # [T, q_rank]
    return matmul(latent, w.q[1])
