"""The sampling contract: greedy, or temperature / top-k / top-p / min-p drawn from a
per-request seeded generator, after the repetition, presence and frequency penalties
and the logit bias (model/penalties.py) adjust the logits.

Given the same logits and the same parameters, the same tokens come out:
the generator draws exactly one uniform per sampled (non-greedy) step and
all arithmetic after the logits is float64 in a fixed order. Since logits
do not depend on the route split or batch composition, neither do tokens.
So a request's whole random state is its seed and the number of uniforms
drawn: a sampler anywhere (the route's last node, its replacement after a
failover) continues a request exactly from those two numbers. The penalties'
state is the ids seen (prompt and generated, and where the generated ones
start), which travel with every step: nothing else to carry or rebuild.

The order, fixed: repetition penalty (on the raw logits), presence and frequency
penalties, logit bias; then greedy takes the largest score, or the scores are
divided by the temperature, cut by min-p, then by top-k and top-p, and sampled.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from meshnet.errors import RequestError
from meshnet.model.penalties import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    PENALTY_LIMIT,
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency,
)

if TYPE_CHECKING:
    from meshnet.model.constraint import Constraint

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    repetition_penalty: float = 1.0  # 1 means none; >1 discourages seen tokens
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = field(default=())  # stop strings, excluded from the text
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each generated id
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence of a generated id
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, added to its logit), ids ascending
    min_p: float = 0.0  # 0 means no cut; else drop ids under min_p x the likeliest's p
    ignore_eos: bool = False  # an end-of-generation id does not stop (max_tokens, stop do)
    # A grammar the sampled ids must follow (model/constraint.py); None: any id
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 < self.repetition_penalty <= 100.0, "repetition_penalty must be in (0, 100]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2^63)"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
            (
                all(0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
                f"stop strings must have 1 to {MAX_STOP_LENGTH} characters",
            ),
        ]
        for ok, message in checks + self._openai_checks():
            if not ok:
                raise RequestError(message)

    def _openai_checks(self) -> list[tuple[bool, str]]:
        ids = [token for token, _ in self.logit_bias]
        return [
            (abs(self.presence_penalty) <= PENALTY_LIMIT, "presence_penalty must be in [-2, 2]"),
            (abs(self.frequency_penalty) <= PENALTY_LIMIT, "frequency_penalty must be in [-2, 2]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (len(ids) <= MAX_LOGIT_BIAS, f"logit_bias holds at most {MAX_LOGIT_BIAS} ids"),
            (
                ids == sorted(set(ids)) and all(i >= 0 for i in ids),
                "logit_bias ids: distinct, >= 0, ascending",
            ),
            (
                all(abs(v) <= LOGIT_BIAS_LIMIT for _, v in self.logit_bias),
                "logit_bias values must be in [-100, 100]",
            ),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a pick depends on the ids seen before it (they travel with each step)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def adjusted(self) -> bool:
        """Whether any penalty or bias changes the logits before the pick."""
        return self.penalised or bool(self.logit_bias)

    @property
    def sees_history(self) -> bool:
        """Whether a pick depends on the ids before it (a sampling hop is sent them)."""
        return self.penalised or self.constraint is not None

    def seeded(self) -> SamplingParams:
        """These parameters with a seed fixed (a fresh random one when none was given)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))


class Sampler:
    """Picks tokens for one request; holds that request's random state."""

    def __init__(self, params: SamplingParams, draws: int = 0) -> None:
        """``draws``: uniforms the request's generator has already drawn (its position)."""
        self.params = params.seeded()
        self.draws = draws
        # Made at the first draw: seeding PCG64 costs more than a greedy pick, which
        # a node makes for every stream's every token.
        self._rng: np.random.Generator | None = None

    def sample(self, logits: np.ndarray, history: Sequence[int], *, generated_from: int) -> int:
        """The next token from logits [vocab]; ``history`` is prompt + generated ids, the
        generated ones from index ``generated_from`` (what presence and frequency count)."""
        p = self.params
        if p.constraint is not None:  # the grammar's refused ids go before anything else
            logits = p.constraint.apply(logits, history)
        if p.greedy and not p.adjusted:
            return int(np.argmax(logits))  # float32 -> float64 is exact: same pick, no copy
        scores = adjust(logits.astype(np.float64), p, history, generated_from)
        if p.greedy:
            return int(np.argmax(scores))  # first of equal maxima: lowest id
        u = self._generator().random()
        self.draws += 1
        scores = apply_min_p(scores / p.temperature, p.min_p)
        return pick(scores, p.top_k, p.top_p, u)

    def _generator(self) -> np.random.Generator:
        """The request's generator, advanced past the uniforms already drawn."""
        if self._rng is None:
            assert self.params.seed is not None  # seeded() fixed it
            bits = np.random.PCG64(self.params.seed)
            if self.draws:
                bits.advance(self.draws)  # one 64-bit output per uniform
            self._rng = np.random.Generator(bits)
        return self._rng


def adjust(
    scores: np.ndarray, p: SamplingParams, history: Sequence[int], generated_from: int
) -> np.ndarray:
    """``scores`` [vocab] float64 after the penalties and the bias, in the contract's order."""
    if p.repetition_penalty != 1.0 and history:
        scores = apply_repetition_penalty(scores, history, p.repetition_penalty)
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        generated = history[max(generated_from, 0) :]
        if generated:
            scores = apply_presence_frequency(
                scores, generated, p.presence_penalty, p.frequency_penalty
            )
    if p.logit_bias:
        scores = apply_logit_bias(scores, p.logit_bias)
    return scores


def apply_repetition_penalty(
    scores: np.ndarray, history: Sequence[int], penalty: float
) -> np.ndarray:
    """CTRL-style penalty (Keskar et al. 2019): seen logits shrink toward less likely."""
    out = scores.copy()
    seen = np.unique(np.asarray(history, dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < len(out))]
    values = out[seen]
    out[seen] = np.where(values > 0, values / penalty, values * penalty)
    return out


def pick(scores: np.ndarray, top_k: int, top_p: float, u: float) -> int:
    """The candidate the uniform ``u`` selects: the first, most likely first (ties: lower
    id first), whose cumulative probability exceeds ``u`` (``nucleus``'s candidates).

    With no cut, only the likeliest ids are sorted, as many as it takes to pass ``u``:
    sorting a whole vocabulary cost milliseconds per sampled token.
    """
    n = len(scores)
    if top_p < 1.0 or 0 < top_k < n:
        ids, probs = nucleus(scores, top_k, top_p)
        index = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return int(ids[min(index, len(ids) - 1)])
    probs = _probabilities(scores)
    k = min(n, _FIRST_LOOK)
    while True:
        part = _likeliest(probs, k)
        index = int(np.searchsorted(np.cumsum(probs[part]), u, side="right"))
        if k == n:
            return int(part[min(index, n - 1)])
        # The look's order is the vocabulary's up to ``index`` when every id outside it
        # (none more likely than the look's last) is less likely than the one picked.
        if index < k and probs[part[index]] > probs[part[-1]]:
            return int(part[index])
        k = min(n, k * 8)


def _probabilities(scores: np.ndarray) -> np.ndarray:
    """``exp(score - max)`` over the sum, taken in id order."""
    weights = np.exp(scores - scores.max())
    return weights / weights.sum()


def _likeliest(probs: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` likeliest indices of ``probs``, most likely first, ties by lower index."""
    part = np.argpartition(-probs, k - 1)[:k] if k < len(probs) else np.arange(len(probs))
    return part[np.lexsort((part, -probs[part]))]


def nucleus(scores: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids, most likely first (ties: lower id first), and their probabilities.

    The contract: probabilities are ``exp(score - max)`` over the candidates (all ids,
    or the ``top_k`` likeliest) divided by their sum taken in id order; ``top_p`` keeps
    the smallest prefix of the candidates whose cumulative probability reaches it,
    renormalised. Only what a ``top_p`` cut keeps is sorted.
    """
    n = len(scores)
    cut = 0 < top_k < n
    ids = np.sort(np.argpartition(-scores, top_k - 1)[:top_k]) if cut else np.arange(n)
    probs = _probabilities(scores[ids])
    if top_p >= 1.0:
        order = _likeliest(probs, len(ids))
        return ids[order], probs[order]
    k = min(len(ids), _FIRST_LOOK)
    while True:
        part = _likeliest(probs, k)  # positions in ``ids``, which is sorted: ties by id
        cumulative = np.cumsum(probs[part])
        keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
        # The prefix is the whole vocabulary's when every id outside the look is less
        # likely than the last one kept (all of them are at most as likely as the look's
        # least likely member).
        if k == len(ids) or (keep < k and probs[part[keep - 1]] > probs[part[-1]]):
            kept = part[: min(keep, k)]
            return ids[kept], probs[kept] / probs[kept].sum()
        k = min(len(ids), k * 8)


_FIRST_LOOK = 64  # candidates sorted first when a top-p cut applies
