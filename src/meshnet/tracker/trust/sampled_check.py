"""The last hop's sampling, checked: the tokens it picked are the sampler's picks from
the verifier's logits.

A last hop's commitment covers its last layer's rows, not the token it sampled
from them: a node that computes honestly but samples another token (or sends
logits, or a token, unrelated to what it committed) is not caught by the rows.
The sampling contract (model/sampling.py) makes the pick a function of the
logits, the request's seeded parameters, the ids seen before it and the number
of uniforms drawn, so the verifier, which re-computed the chunk's rows, can
pick again from their logits and compare.

Only tokens the claim's node sampled are checked: after a failover the ids a
failed last hop picked stay in the history, and a replacement must not answer
for them. On an exact backend the pick must be the same id; on one that is not
(numpy), only greedy picks are checked, and an id whose logit is within a
tolerance of the largest passes (near-ties may fall either way there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshnet.errors import MeshnetError
from meshnet.model.sampling import Sampler, SamplingParams

# A greedy pick on a backend that is not exact passes when its logit is at most this
# share of max(|largest logit|, 1) below the largest: honest BLAS differences are far
# below it, and a pick other than the likeliest is almost always far more.
GREEDY_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Sampled:
    """Tokens a last hop sampled from a chunk's positions, and how it was to pick them."""

    params: SamplingParams  # the generation's, seed fixed
    first: int  # position of the generation's first sampled id (its draw 0)
    tokens: tuple[tuple[int, int], ...]  # (position q, id): picked from position q-1's logits


def check_sampled(
    logits: np.ndarray,
    row_start: int,
    history: Sequence[int],
    sampled: Sampled,
    exact: bool = True,
) -> str:
    """Why a token in ``sampled`` is not the sampler's pick; "" when every one is.

    ``logits`` [T, vocab] are the verifier's for positions ``row_start``..; ``history``
    the ids fed at positions [0, q) for every token's q (the claim's tokens)."""
    params = sampled.params
    for q, token in sampled.tokens:
        p = q - 1
        if not (row_start <= p < row_start + len(logits)) or q > len(history) or q < 1:
            return f"a sampled id at position {q} outside the chunk"
        row = logits[p - row_start]
        if params.constraint is not None:  # the pick was made from the grammar's ids only
            try:
                row = params.constraint.apply(row, history[:q])
            except MeshnetError as e:
                return f"position {q}: {e.message}"
        if not exact:
            if not params.greedy or params.adjusted:
                continue  # a pick from near-equal probabilities may differ here
            best = float(row.max())
            if float(row[token]) >= best - GREEDY_TOLERANCE * max(abs(best), 1.0):
                continue
            return f"position {q}: sampled {token}, far from the likeliest {int(row.argmax())}"
        draws = 0 if params.greedy else q - sampled.first
        if draws < 0:
            return f"a sampled id at position {q}, before the generation's first"
        pick = Sampler(replace(params, constraint=None), draws).sample(
            row, history[:q], generated_from=sampled.first
        )
        if pick != token:
            return f"position {q}: sampled {token}, the verifier's sampler picks {pick}"
    return ""
