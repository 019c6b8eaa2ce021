"""The mixtures of experts as llama-quantize writes them (Q4_K_M: Q4_K and Q6_K experts;
gpt-oss in MXFP4) against llama.cpp on the same weights dequantized to float32, their
exact reference; the q8 backend against llama.cpp on the quantized file itself, whose
8-bit activations it shares.

The files and llama.cpp's greedy steps were recorded by ``scripts/record_quant_oracles.py``
(tests/fixtures/quant/, tests/fixtures/quant_oracle.json). 8-bit activations move a
tiny random model's log-probs by tenths (a router near a tie then picks other experts),
so the q8 backend is held to the run that shares them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from invariants import assert_split_batched_chunked_identical, banned_greedy, step_logits

from meshnet.engine.local import load_local_model
from meshnet.model.gguf_file import open_gguf

FIXTURES = Path(__file__).parents[1] / "fixtures"
ORACLE = json.loads((FIXTURES / "quant_oracle.json").read_text())
MARGIN = 1e-3  # greedy ids are compared up to the first step whose top two are this close


@pytest.fixture(scope="module", params=sorted(ORACLE["cases"]))
def case(request: pytest.FixtureRequest) -> tuple[Path, dict[str, Any]]:
    name = request.param
    path = FIXTURES / "quant" / f"{name}.gguf"
    recorded = ORACLE["cases"][name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded["sha256"]
    return path, recorded


def _compared_steps(recorded: dict[str, Any], steps: str = "steps") -> int:
    """How many of llama.cpp's ``steps`` come before its first gap under ``MARGIN``
    between its pick and the next unbanned id (below its listed top when none is listed)."""
    banned = set(recorded["banned_ids"])
    for step, theirs in enumerate(recorded[steps]):
        allowed = [lp for token, lp in theirs["top"] if token not in banned]
        runner_up = allowed[1] if len(allowed) > 1 else theirs["top"][-1][1]
        if not allowed or allowed[0] - runner_up < MARGIN:
            return step
    return len(recorded[steps])


def test_the_files_hold_quantized_experts(case: tuple[Path, dict[str, Any]]) -> None:
    path, recorded = case
    f = open_gguf(path)
    experts = {n: t for n, t in f.tensors.items() if n.endswith("_exps.weight")}
    assert experts and all(len(t.shape) == 3 for t in experts.values())
    want = {"MXFP4"} if recorded["quantization"] == "MXFP4_MOE" else {"Q4_K", "Q6_K"}
    assert {recorded["types"][n] for n in experts} <= want


@pytest.mark.parametrize("backend", ["numpy", "fast"])
def test_greedy_ids_and_logprobs_match_llamacpp_on_the_dequantized_weights(
    case: tuple[Path, dict[str, Any]], backend: str
) -> None:
    path, recorded = case
    ids, logprobs = banned_greedy(load_local_model(path, backend=backend).chain, recorded)
    steps = _compared_steps(recorded)
    assert steps >= 4, "the oracle's prompt reaches a near tie too soon to tell anything"
    compared = zip(recorded["steps"][:steps], ids[:steps], logprobs[:steps], strict=True)
    for step, (theirs, mine, lp) in enumerate(compared):
        for token, logprob in theirs["top"]:
            assert abs(lp[token] - logprob) < 1e-3, (step, token)
        assert mine == theirs["id"], step


def test_q8_backend_gives_llamacpps_ids_on_the_quantized_file(
    case: tuple[Path, dict[str, Any]],
) -> None:
    path, recorded = case
    ids, _ = banned_greedy(load_local_model(path, backend="q8").chain, recorded)
    steps = _compared_steps(recorded, "quantized_steps")
    assert steps >= 2, "llama.cpp's run reaches a near tie too soon to tell anything"
    assert ids[:steps] == [s["id"] for s in recorded["quantized_steps"][:steps]]


def test_fast_backend_equals_the_dequantized_reference(case: tuple[Path, dict[str, Any]]) -> None:
    path, recorded = case
    prompt, follow = recorded["prompt_ids"], [s["id"] for s in recorded["steps"]][:6]
    fast = step_logits(load_local_model(path, backend="fast").chain, prompt, follow)
    ref = step_logits(load_local_model(path, backend="numpy").chain, prompt, follow)
    assert np.max(np.abs(fast - ref)) < 1e-4 * np.max(np.abs(ref))


@pytest.mark.parametrize("backend", ["fast", "q8"])
def test_quantized_experts_are_bit_identical_split_batched_and_chunked(
    case: tuple[Path, dict[str, Any]], backend: str
) -> None:
    """A row's experts give it the same bits whichever other rows chose them too."""
    path, recorded = case
    prompt, follow = recorded["prompt_ids"], [s["id"] for s in recorded["steps"]][:6]
    whole = load_local_model(path, backend=backend)
    split = load_local_model(path, backend=backend, split=2)
    assert_split_batched_chunked_identical(whole.chain, split.chain, prompt, follow)
