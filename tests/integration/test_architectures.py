"""Every supported architecture against llama.cpp, against the float32 reference, and
under the engine's invariants (split, batched, chunked, cached == the whole).

llama.cpp's greedy steps and top log-probs on each tiny model were recorded by
``scripts/record_arch_oracles.py`` (tests/fixtures/arch_oracle.json) on the same
bytes ``tests/tinyarch.py`` writes here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from invariants import assert_split_batched_chunked_identical, banned_greedy, step_logits
from tinyarch import CASES, write_arch_gguf

from meshnet.engine.local import load_local_model

ORACLE = json.loads((Path(__file__).parents[1] / "fixtures" / "arch_oracle.json").read_text())
MARGIN = 1e-3  # greedy ids are compared up to the first step whose top two are this close
# llama.cpp's GELU reads a float16 table; elsewhere it computes in float32 as we do.
LOGPROB_TOLERANCE = {"gemma2": 5e-3, "gemma3": 5e-3}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:  # type: ignore[type-arg]
    name = request.param
    path = write_arch_gguf(tmp_path_factory.mktemp("arch") / f"{name}.gguf", CASES[name])
    recorded = ORACLE["cases"][name]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == recorded["sha256"], "tinyarch.py changed: rerun scripts/record_arch_oracles.py"
    return name, path, recorded


@pytest.mark.parametrize("backend", ["numpy", "fast"])
def test_greedy_ids_and_top_logprobs_match_llamacpp(case: tuple, backend: str) -> None:  # type: ignore[type-arg]
    name, path, recorded = case
    model = load_local_model(path, backend=backend)
    ids, logprobs = banned_greedy(model.chain, recorded)
    tolerance = LOGPROB_TOLERANCE.get(name, 1e-4)
    banned = set(recorded["banned_ids"])
    for step, (theirs, mine, lp) in enumerate(zip(recorded["steps"], ids, logprobs, strict=True)):
        for token, logprob in theirs["top"]:  # llama.cpp's log-probs ignore the ban
            assert abs(lp[token] - logprob) < tolerance, (name, step, token)
        allowed = [lp for token, lp in theirs["top"] if token not in banned]
        if len(allowed) < 2 or allowed[0] - allowed[1] < MARGIN:
            break  # a near tie (or too few to tell): past here the order is rounding
        assert mine == theirs["id"], (name, step)


def test_fast_backend_matches_the_float32_reference(case: tuple) -> None:  # type: ignore[type-arg]
    _, path, recorded = case
    prompt, follow = recorded["prompt_ids"], [s["id"] for s in recorded["steps"]][:6]
    fast = step_logits(load_local_model(path, backend="fast").chain, prompt, follow)
    ref = step_logits(load_local_model(path, backend="numpy").chain, prompt, follow)
    assert np.max(np.abs(fast - ref)) < 1e-4 * np.max(np.abs(ref))


@pytest.mark.parametrize("backend", ["fast", "q8"])
def test_split_batched_chunked_and_cached_logits_are_bit_identical(
    case: tuple, backend: str
) -> None:  # type: ignore[type-arg]
    _, path, recorded = case
    prompt, follow = recorded["prompt_ids"], [s["id"] for s in recorded["steps"]][:6]
    whole = load_local_model(path, backend=backend)
    split = load_local_model(path, backend=backend, split=3)
    assert_split_batched_chunked_identical(whole.chain, split.chain, prompt, follow)
