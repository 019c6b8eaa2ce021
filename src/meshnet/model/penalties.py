"""OpenAI's logit adjustments: presence and frequency penalties, logit bias, min-p.

Each is a pure function of the logits and of ids the request already holds, so a
sampler anywhere (the route's last node, its replacement after a failover, the
verifier re-checking a pick) rebuilds the same scores from the same ids; there
is no state to carry but the ids. Arithmetic is float64 in a fixed order.

The formulas are OpenAI's (platform.openai.com/docs/advanced-usage, "frequency
and presence penalties")::

    mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty

where ``c[j]`` counts token ``j`` among the ids *generated so far* (not the
prompt's), and ``logit_bias`` adds its value to its token's logit before
sampling. ``min_p`` (not OpenAI's; vLLM's and llama.cpp's) drops every token
whose probability at the sampling temperature is below ``min_p`` times the
likeliest one's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias (OpenAI's bound)
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's bound)
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| at most this (OpenAI's)


def apply_presence_frequency(
    scores: np.ndarray, generated: Sequence[int], presence: float, frequency: float
) -> np.ndarray:
    """``scores`` [vocab] less OpenAI's presence and frequency penalties for the ids
    ``generated`` so far (ids outside the vocabulary are ignored)."""
    out = scores.copy()
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    inside = (ids >= 0) & (ids < len(out))
    ids, counts = ids[inside], counts[inside]
    out[ids] -= counts * frequency + presence
    return out


def apply_logit_bias(scores: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """``scores`` [vocab] with each ``(id, value)`` of ``bias`` added to its id's score."""
    out = scores.copy()
    for token, value in bias:  # ids are distinct and checked against the vocabulary
        out[token] += value
    return out


def apply_min_p(scores: np.ndarray, min_p: float) -> np.ndarray:
    """``scores`` [vocab] (already divided by the temperature) with every id whose
    probability is under ``min_p`` times the likeliest's set to -inf.

    ``p[j] >= min_p * p_max`` is ``scores[j] - max(scores) >= log(min_p)``: no softmax
    is needed, and the likeliest id always stays."""
    if min_p <= 0.0:
        return scores
    floor = float(scores.max()) + math.log(min_p)
    return np.where(scores >= floor, scores, -np.inf)
