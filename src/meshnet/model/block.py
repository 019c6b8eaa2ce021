"""One decoder block in numpy, for every supported family, reading like the math.

The family's differences (latent attention, Q/K/V biases, per-head Q/K norms, rotary layout,
post-norms, the FFN's activation, attention scale / soft-cap / window) come
from ``ModelSpec`` and the block's weights; how a matrix is multiplied and how
a batch's sequences attend are the caller's (the reference backend: float32
BLAS; the fast backend's fallback: its row kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from meshnet.model.experts import mixture
from meshnet.model.latent_attention import latent_attention
from meshnet.model.layers import gated, rms_norm, sigmoid
from meshnet.model.rope import rotate
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import LayerWeights

W = TypeVar("W")
Matmul = Callable[[np.ndarray, W], np.ndarray]  # (x [T, in], W [out, in]) -> x @ W.T [T, out]
# (q [T, H, hd], k, v [T, Hkv, hd]) -> [T, H * hd]: stores k, v in each sequence's cache
# and attends each sequence's rows over it.
Attend = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def forward_block(
    spec: ModelSpec,
    w: LayerWeights[W],
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    matmul: Matmul[W],
    attend: Attend,
) -> np.ndarray:
    """x [T, d] after the block; cos, sin [T, rope pairs] of the rows' positions."""
    eps = spec.rms_eps
    h = rms_norm(x, w.attn_norm, eps)  # [T, d]
    if w.mla is not None:
        heads = latent_attention(spec, w.mla, h, cos, sin, matmul, attend)  # [T, H * v]
    else:
        heads = _attention(spec, w, h, cos, sin, matmul, attend)  # [T, H * hd]
    out = matmul(heads, w.wo)  # [T, d]
    if w.wo_bias is not None:
        out = out + w.wo_bias
    if w.post_attn_norm is not None:
        out = rms_norm(out, w.post_attn_norm, eps)
    x = x + out
    h = rms_norm(x, w.ffn_norm, eps)
    out = feed_forward(spec, w, h, matmul)  # [T, d]
    if w.post_ffn_norm is not None:
        out = rms_norm(out, w.post_ffn_norm, eps)
    return x + out  # [T, d]


def _attention(
    spec: ModelSpec,
    w: LayerWeights[W],
    h: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    matmul: Matmul[W],
    attend: Attend,
) -> np.ndarray:
    """Grouped-query attention's heads [T, H * hd] of normed rows h [T, d]."""
    t, eps, hd = h.shape[0], spec.rms_eps, spec.head_dim
    qkv = _project(h, w.qkv, matmul)  # [T, q + 2 kv]
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    q, k, v = np.split(qkv, [spec.q_width, spec.q_width + spec.kv_width], axis=1)
    q = q.reshape(t, spec.n_heads, hd)  # [T, H, hd]
    k = k.reshape(t, spec.n_kv_heads, hd)  # [T, Hkv, hd]
    v = np.ascontiguousarray(v).reshape(t, spec.n_kv_heads, hd)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    q = rotate(q, cos, sin, spec.rope.style)
    k = rotate(k, cos, sin, spec.rope.style)
    return attend(q, k, v)


def feed_forward(
    spec: ModelSpec, w: LayerWeights[W], h: np.ndarray, matmul: Matmul[W]
) -> np.ndarray:
    """The block's feed-forward of normed rows h [T, d]: the dense FFN, or a mixture of
    experts plus its shared expert (gated by ``sigmoid(shared_gate . h)`` where it is)."""
    out = None
    if spec.experts is not None and w.experts is not None:
        out = mixture(spec.experts, w.experts, h, matmul, spec.ffn_activation)
    if w.w_down is not None:
        dense = matmul(gated(_project(h, w.gate_up, matmul), spec.ffn_activation), w.w_down)
        if w.shared_gate is not None:
            dense = dense * sigmoid(np.sum(h * w.shared_gate, axis=-1, keepdims=True))
        out = dense if out is None else out + dense
    if out is None:
        raise ValueError("a block with no feed-forward")
    return out


def _project(x: np.ndarray, parts: tuple[W, ...], matmul: Matmul[W]) -> np.ndarray:
    """x times the parts' rows laid side by side: [T, sum of their rows]."""
    if len(parts) == 1:
        return matmul(x, parts[0])
    return np.concatenate([matmul(x, p) for p in parts], axis=1)
