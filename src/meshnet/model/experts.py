"""A mixture of experts' feed-forward in numpy, reading like the math (the reference).

A router scores every expert for a row; the row goes through its ``k`` best experts
only, and their outputs are summed by the router's weights. How a batch's rows are
grouped by expert is the caller's business: each row's result depends on its own
values alone (its chosen experts, their weights and the sum's order), never on which
other rows chose the same experts.

Shapes: ``T`` rows, ``d`` model width, ``E`` experts, ``k`` used per row, ``f`` an
expert's hidden width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from meshnet.model.layers import gated, sigmoid, softmax
from meshnet.model.spec import Experts
from meshnet.model.weights import ExpertWeights

F32 = np.float32
W = TypeVar("W")
Matmul = Callable[[np.ndarray, W], np.ndarray]  # (x [T, in], W [out, in]) -> [T, out]
# llama.cpp clamps the sum of the chosen weights to float16's smallest normal before dividing.
_MIN_WEIGHT_SUM = F32(6.103515625e-5)


def route(
    logits: np.ndarray, experts: Experts, bias: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The chosen experts of each row and their weights: ids [T, k] (best first) and
    weights [T, k] float32, from the router's logits [T, E].

    "softmax": a softmax over every expert, the ``k`` most probable kept with their
    probabilities; "sigmoid": each expert's sigmoid, likewise; "softmax_chosen": the ``k``
    largest logits, then a softmax over those. ``bias`` [E] (DeepSeek-V3's ``exp_probs_b``)
    is added to the probabilities to choose, never to the weights; grouped experts are
    chosen among the best groups only (``_best_groups``). Ties go to the lower expert id.
    ``normalize`` divides the weights by their sum, then ``scale`` multiplies them.
    """
    k = experts.n_used
    gating = experts.gating
    probs = softmax(logits) if gating == "softmax" else logits  # [T, E]
    if gating == "sigmoid":
        probs = sigmoid(logits)
    chosen_by = probs if bias is None else probs + bias  # [T, E]
    if experts.grouped:
        chosen_by = _best_groups(chosen_by, experts)
    ids = np.argsort(-chosen_by, axis=-1, kind="stable")[:, :k]  # [T, k]
    weights: np.ndarray = np.take_along_axis(probs, ids, axis=-1).astype(F32)  # [T, k]
    if gating == "softmax_chosen":
        weights = softmax(weights)
    if experts.normalize:
        total = np.maximum(np.sum(weights, axis=-1, keepdims=True, dtype=F32), _MIN_WEIGHT_SUM)
        weights = weights / total
    if experts.scale != 1.0:
        weights = weights * F32(experts.scale)
    return ids, weights


def _best_groups(scores: np.ndarray, experts: Experts) -> np.ndarray:
    """scores [T, E] with every expert outside a row's ``n_groups_used`` best groups at
    -inf: a group's score is the sum of its two best experts' (DeepSeek-V3; llama.cpp's
    ``build_moe_ffn``), ties to the lower group."""
    t, g = scores.shape[0], experts.n_groups
    grouped = scores.reshape(t, g, -1)  # [T, G, E / G]
    top2 = -np.sort(-grouped, axis=-1, kind="stable")[..., :2]  # [T, G, 2]
    group_scores = top2[..., 0] + top2[..., 1]  # [T, G]
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, : experts.n_groups_used]
    kept = np.zeros((t, g), dtype=bool)
    np.put_along_axis(kept, best, True, axis=-1)
    return np.where(kept[..., None], grouped, F32(-np.inf)).reshape(scores.shape)


def mixture(
    experts: Experts,
    w: ExpertWeights[W],
    h: np.ndarray,
    matmul: Matmul[W],
    activation: str,
) -> np.ndarray:
    """The mixture's output [T, d] for normed rows h [T, d]: each row's experts' outputs
    weighted and summed in the order of its choice (as llama.cpp adds them)."""
    logits = matmul(h, w.router)  # [T, E]
    if w.router_bias is not None:
        logits = logits + w.router_bias
    ids, weights = route(logits, experts, w.selection_bias)  # [T, k] each
    outs = np.empty((h.shape[0], experts.n_used, h.shape[1]), F32)  # [T, k, d]
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)  # the rows that chose e, and in which place
        outs[rows, slots] = _expert(w, int(e), h[rows], matmul, activation)
    out = outs[:, 0] * weights[:, :1]
    for s in range(1, experts.n_used):
        out = out + outs[:, s] * weights[:, s : s + 1]
    return out  # [T, d]


def _expert(
    w: ExpertWeights[W], e: int, h: np.ndarray, matmul: Matmul[W], activation: str
) -> np.ndarray:
    """Expert ``e``'s gated FFN of rows h [n, d] -> [n, d]."""
    parts = w.gate_up[e]
    if len(parts) == 1:
        gate_up = matmul(h, parts[0])  # [n, 2f]
        gate, up = np.split(gate_up, 2, axis=1)
    else:
        gate, up = matmul(h, parts[0]), matmul(h, parts[1])  # [n, f] each
    if w.gate_bias is not None and w.up_bias is not None:
        gate, up = gate + w.gate_bias[e], up + w.up_bias[e]
    out = matmul(gated(np.concatenate([gate, up], axis=1), activation), w.down[e])  # [n, d]
    return out + w.down_bias[e] if w.down_bias is not None else out
