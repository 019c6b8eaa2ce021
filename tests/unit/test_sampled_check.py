"""The last hop's picks, checked: ids it sampled from honest rows must be the sampler's
picks from the verifier's logits, greedy or seeded, penalised or not."""

from pathlib import Path

import numpy as np
import pytest

from meshnet.layer_range import LayerRange
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.protocol.commitments import CHUNK_TOKENS, chunk_digests_of
from meshnet.tracker.trust.sampled_check import Sampled, check_sampled
from meshnet.tracker.trust.verifier import SpanClaim, TrustedModel, check_span

PROMPT = 40  # the first sampled id is at position 40, picked from position 39's logits
START = 32  # the chunk checked: positions [32, 64), whose picks are ids 40..64

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SEEDED = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=7)
OPENAI = SamplingParams(  # OpenAI's controls: penalties over the generated ids, a bias, min-p
    max_tokens=32,
    temperature=0.8,
    presence_penalty=1.5,
    frequency_penalty=2.0,
    logit_bias=((3, 5.0), (17, -100.0)),
    min_p=0.05,
    seed=11,
)
GREEDY_BIASED = SamplingParams(max_tokens=32, frequency_penalty=2.0, logit_bias=((5, 4.0),))
CASES = [GREEDY, SEEDED, OPENAI, GREEDY_BIASED]
CASE_IDS = ["greedy", "seeded-penalised", "openai-controls", "greedy-biased"]


@pytest.fixture(scope="module")
def trusted(tiny_path: Path) -> TrustedModel:
    return TrustedModel(str(tiny_path), backend="fast")


def _generate(model: TrustedModel, params: SamplingParams, wrong_at: int = -1) -> list[int]:
    """A prompt and 25 ids picked under ``params``; the id at position ``wrong_at`` is
    another than the sampler's (a last hop that computed honestly, then lied)."""
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 200, PROMPT)]
    end = model.spec.n_layers
    for draws in range(25):
        logits = model.logits_of(model.boundary_rows(np.asarray(ids), end)[-1])
        pick = Sampler(params, 0 if params.greedy else draws).sample(
            logits, ids, generated_from=PROMPT
        )
        ids.append((pick + 1) % len(logits) if len(ids) == wrong_at else pick)
    return ids


def _claim(
    model: TrustedModel, ids: list[int], params: SamplingParams, skip: int = -1
) -> SpanClaim:
    """The last hop's claim on chunk [32, 64): honest rows of ``ids``, and its picks
    (every id from position 40 to 64, but ``skip``, which another node picked)."""
    end = START + CHUNK_TOKENS
    layers = LayerRange(0, model.spec.n_layers)
    rows = model.boundary_rows(np.asarray(ids[:end]), layers.end)
    digest = chunk_digests_of(rows, 0)[START]
    picked = tuple((q, ids[q]) for q in range(PROMPT, end + 1) if q != skip)
    sampled = Sampled(params, PROMPT, picked)
    return SpanClaim("last", "g", layers, START, digest, tuple(ids[:end]), (), sampled)


@pytest.mark.parametrize("params", CASES, ids=CASE_IDS)
def test_honest_picks_pass(trusted: TrustedModel, params: SamplingParams) -> None:
    ids = _generate(trusted, params)
    verdict = check_span(trusted, _claim(trusted, ids, params))
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("params", CASES, ids=CASE_IDS)
def test_a_last_hop_that_picks_another_id_fails_though_its_rows_are_honest(
    trusted: TrustedModel, params: SamplingParams
) -> None:
    ids = _generate(trusted, params, wrong_at=50)
    verdict = check_span(trusted, _claim(trusted, ids, params))
    assert not verdict.passed
    assert "position 50" in verdict.detail and "sampled other ids" in verdict.detail


@pytest.mark.parametrize("params", [OPENAI, GREEDY_BIASED], ids=["seeded", "greedy"])
def test_a_last_hop_that_ignores_the_penalties_and_bias_fails(
    trusted: TrustedModel, params: SamplingParams
) -> None:
    plain = SamplingParams(
        max_tokens=32, temperature=params.temperature, min_p=params.min_p, seed=params.seed
    )
    ids = _generate(trusted, plain)  # what a node sampling without them picks
    assert ids != _generate(trusted, params)
    verdict = check_span(trusted, _claim(trusted, ids, params))
    assert not verdict.passed and "sampled other ids" in verdict.detail


def test_a_pick_another_node_made_is_not_held_against_this_one(trusted: TrustedModel) -> None:
    """After a failover the ids a failed last hop picked stay in the history: its
    replacement answers only for its own."""
    ids = _generate(trusted, GREEDY, wrong_at=50)
    verdict = check_span(trusted, _claim(trusted, ids, GREEDY, skip=50))
    assert verdict.passed, verdict.detail


def test_without_exact_numerics_a_greedy_near_tie_passes_and_a_far_pick_fails() -> None:
    logits = np.zeros((2, 5), np.float32)
    logits[:, 1], logits[:, 3] = 10.0, 10.001  # a near tie, argmax 3
    near = Sampled(GREEDY, 1, ((1, 1),))
    far = Sampled(GREEDY, 1, ((1, 0),))
    assert check_sampled(logits, 0, [0, 0], near, exact=False) == ""
    assert "position 1" in check_sampled(logits, 0, [0, 0], near, exact=True)
    assert "far from the likeliest 3" in check_sampled(logits, 0, [0, 0], far, exact=False)
    seeded = Sampled(SEEDED, 1, ((1, 0),))  # cannot be decided without exact logits
    assert check_sampled(logits, 0, [0, 0], seeded, exact=False) == ""


def test_a_pick_outside_the_chunk_fails() -> None:
    logits = np.zeros((2, 5), np.float32)
    assert "outside the chunk" in check_sampled(logits, 10, [0] * 20, Sampled(GREEDY, 0, ((5, 1),)))
