"""OpenAI's sampling controls (presence / frequency penalties, logit bias, min-p)
against a plain numpy reference written from their documented formulas."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.errors import RequestError
from meshnet.model.penalties import apply_logit_bias, apply_min_p, apply_presence_frequency
from meshnet.model.sampling import Sampler, SamplingParams, adjust

VOCAB = 300
rng = np.random.default_rng(11)
LOGITS = [rng.standard_normal(VOCAB).astype(np.float32) * 3 for _ in range(30)]


def _reference_penalties(
    logits: np.ndarray, generated: list[int], presence: float, frequency: float
) -> np.ndarray:
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence, one id at a time."""
    out = logits.astype(np.float64)
    for j in range(len(out)):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return out


def _reference_min_p(scores: np.ndarray, min_p: float) -> np.ndarray:
    p = np.exp(scores - scores.max())
    p /= p.sum()
    return np.where(p >= min_p * p.max(), scores, -np.inf)


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (1.5, 0.0), (0.0, 2.0), (-2.0, 0.7)])
def test_presence_and_frequency_penalties_match_openai_formula(
    presence: float, frequency: float
) -> None:
    generated = [int(t) for t in rng.integers(0, VOCAB, 40)] + [7, 7, 7]
    logits = LOGITS[0]
    got = apply_presence_frequency(logits.astype(np.float64), generated, presence, frequency)
    assert np.allclose(got, _reference_penalties(logits, generated, presence, frequency))


def test_logit_bias_adds_each_value_to_its_id() -> None:
    logits = LOGITS[1].astype(np.float64)
    want = logits.copy()
    want[4] += 100.0
    want[250] -= 3.5
    assert np.array_equal(apply_logit_bias(logits, ((4, 100.0), (250, -3.5))), want)


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 1.0])
def test_min_p_keeps_the_ids_at_least_min_p_times_the_likeliest(min_p: float) -> None:
    scores = LOGITS[2].astype(np.float64) / 0.7
    got = apply_min_p(scores, min_p)
    want = scores if min_p == 0 else _reference_min_p(scores, min_p)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.array_equal(got[np.isfinite(got)], scores[np.isfinite(want)])


def test_penalties_count_only_the_generated_ids() -> None:
    """The prompt's ids are not penalised: OpenAI counts the completion's tokens."""
    logits = np.zeros(5, np.float32)
    logits[2] = 1.0
    params = SamplingParams(frequency_penalty=2.0)
    assert Sampler(params).sample(logits, [2, 2, 2], generated_from=3) == 2  # all prompt
    assert Sampler(params).sample(logits, [2, 2, 2], generated_from=2) == 0  # one generated


def test_adjust_orders_repetition_then_penalties_then_bias() -> None:
    p = SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, 1.0),)
    )
    logits = np.array([4.0, -2.0, 1.0])
    got = adjust(logits, p, [9, 0, 0, 1], generated_from=1)  # id 9 is the prompt (outside)
    # repetition: 4 -> 2, -2 -> -4; then 0 seen twice: -2*0.25-0.5, 1 once: -0.25-0.5; bias +1
    assert got.tolist() == [2.0 - 1.0, -4.0 - 0.75 + 1.0, 1.0]


def test_a_large_negative_bias_bans_a_token_and_a_large_positive_forces_it() -> None:
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed, logit_bias=((0, -100.0),))
        s = Sampler(params)
        assert all(s.sample(lg, [], generated_from=0) != 0 for lg in LOGITS)
    forced = Sampler(SamplingParams(temperature=1.0, seed=1, logit_bias=((42, 100.0),)))
    assert {forced.sample(lg, [], generated_from=0) for lg in LOGITS} == {42}


def test_a_frequency_penalty_stops_greedy_repeats() -> None:
    logits = np.zeros(10, np.float32)
    logits[3] = 1.0  # greedy picks 3 forever
    params = SamplingParams(frequency_penalty=2.0)
    history: list[int] = [5]  # the prompt
    for _ in range(6):
        history.append(Sampler(params).sample(logits, history, generated_from=1))
    assert history[1:] == [3, 0, 1, 2, 4, 5]


def test_controls_are_deterministic_under_a_seed_and_resume_from_the_ids() -> None:
    """A sampler made afresh at draw n with the ids so far (a failover's replacement)
    picks what the one that ran all along picks."""
    params = SamplingParams(
        temperature=0.9, presence_penalty=0.8, frequency_penalty=0.6, min_p=0.05, seed=3
    )
    prompt = [1, 2, 3]

    def run(switch_at: int) -> list[int]:
        history, sampler = list(prompt), Sampler(params)
        for i, lg in enumerate(LOGITS):
            if i == switch_at:
                sampler = Sampler(params, draws=i)
            history.append(sampler.sample(lg, history, generated_from=len(prompt)))
        return history[len(prompt) :]

    assert run(-1) == run(-1) == run(12)
    assert run(-1) != _plain(prompt)


def _plain(prompt: list[int]) -> list[int]:
    history, sampler = list(prompt), Sampler(SamplingParams(temperature=0.9, seed=3))
    for lg in LOGITS:
        history.append(sampler.sample(lg, history, generated_from=len(prompt)))
    return history[len(prompt) :]


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.1),
        dict(frequency_penalty=-2.5),
        dict(min_p=1.5),
        dict(min_p=-0.1),
        dict(logit_bias=((1, 101.0),)),
        dict(logit_bias=((2, 1.0), (1, 1.0))),
        dict(logit_bias=tuple((i, 1.0) for i in range(301))),
    ],
)
def test_out_of_range_controls_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**bad)  # type: ignore[arg-type]
