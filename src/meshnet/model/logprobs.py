"""Log-probabilities of a step's tokens under the model, as the OpenAI API reports them.

They are the log-softmax of the raw logits (before temperature, penalties or
cuts), in float64, so they do not depend on how the token was picked. The
alternatives are the most likely ids, ties broken by lower id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (id, logprob), most likely first


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under logits [vocab], and the ``top`` likeliest ids'."""
    scores = logits.astype(np.float64)
    peak = float(scores.max())
    log_z = peak + float(np.log(np.exp(scores - peak).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        n = min(top, len(scores))
        part = np.argpartition(-scores, n - 1)[:n]
        order = part[np.lexsort((part, -scores[part]))]
        best = tuple((int(i), float(scores[i] - log_z)) for i in order)
    return TokenLogprobs(token, float(scores[token] - log_z), best)
