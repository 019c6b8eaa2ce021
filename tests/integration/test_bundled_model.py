"""The bundled SmolLM2-135M-Instruct against the reference oracle, and the engine's
golden invariants on the real weights.

The oracle (fixtures/oracle.json) is an fp32 implementation's, so it is matched on
``fast``, whose activations are float32 as its are; the default backend, q8, multiplies
8-bit activations as llama.cpp does and parts from it within q8's noise (its ids are
checked against the float32 reference in tests/unit/test_q8_models.py). The bit-identity
invariants hold on both exact backends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from invariants import recomputed_logits, solo_and_batched_ids, step_logits

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.errors import ModelFileError
from meshnet.model.bundled import bundled_model_path
from meshnet.model.sampling import SamplingParams

pytestmark = pytest.mark.bundled

ROUND_TRIP = [
    "Hello, world!  Two spaces,\ttab and\nnewline\n\n",
    "Digits 0123456789 and 3.14159, 1,000,000",
    "Accents: café, naïve, Ærøskøbing, ñandú, Straße",
    "CJK: 日本語のテキスト, 中文, 한국어",
    "Emoji: 😀🎉👩‍👩‍👧 🇫🇷",
    "def f(x: int) -> int:\n    return x ** 2  # squared\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "   leading and trailing   ",
]


def _cases(oracle: dict[str, Any]) -> list[dict[str, Any]]:
    return oracle["cases"]


@pytest.fixture(scope="module")
def fast_model() -> LocalModel:
    """The bundled model on ``fast`` (the oracle's float32 activations)."""
    return load_local_model(backend="fast")


@pytest.fixture(scope="module")
def split3() -> LocalModel:
    return load_local_model(split=3, backend="fast")


@pytest.fixture(scope="module")
def reference() -> LocalModel:
    return load_local_model(backend="numpy")


def test_prompt_ids_equal_the_oracle(fast_model: LocalModel, oracle: dict[str, Any]) -> None:
    for case in _cases(oracle):
        assert fast_model.tokenizer.encode(case["prompt_text"]) == case["prompt_ids"], case["name"]


def test_chat_template_renders_the_oracle_prompts(
    fast_model: LocalModel, oracle: dict[str, Any]
) -> None:
    from meshnet.model.chat import ChatMessage

    capital = _cases(oracle)[0]
    text = fast_model.template.render([ChatMessage("user", "What is the capital of France?")])
    assert text == capital["prompt_text"]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_encode_round_trip(fast_model: LocalModel, text: str) -> None:
    assert fast_model.tokenizer.decode(fast_model.tokenizer.encode(text)) == text


@pytest.mark.parametrize("which", ["single", "split3", "reference"])
def test_greedy_ids_equal_the_oracle(
    which: str, fast_model: LocalModel, request: pytest.FixtureRequest, oracle: dict[str, Any]
) -> None:
    model = fast_model if which == "single" else request.getfixturevalue(which)
    for case in _cases(oracle):
        g = generate(
            model.chain, model.tokenizer, case["prompt_ids"], SamplingParams(max_tokens=48)
        )
        assert g.ids == case["hf_greedy_ids"], case["name"]
        stopped_on_eos = case["hf_greedy_ids"][-1] == 2
        assert g.finish_reason == ("stop" if stopped_on_eos else "length")
        assert g.text == case["hf_greedy_text"].removesuffix("<|im_end|>")


def test_first_step_logits_match_the_oracle_top5(
    fast_model: LocalModel, oracle: dict[str, Any]
) -> None:
    for case in _cases(oracle):
        logits = step_logits(fast_model.chain, case["prompt_ids"], case["hf_greedy_ids"][:2])
        for step, top5 in enumerate(case["hf_top5_first_steps"]):
            ids = [i for i, _ in top5]
            assert np.argsort(-logits[step])[:5].tolist() == ids
            assert np.allclose(logits[step][ids], [v for _, v in top5], atol=2e-3)


@pytest.mark.parametrize("backend", ["fast", "q8"])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_split_logits_are_bit_identical(
    k: int, backend: str, fast_model: LocalModel, bundled: LocalModel, oracle: dict[str, Any]
) -> None:
    case = _cases(oracle)[1]
    follow = case["hf_greedy_ids"][:6]
    whole = {"fast": fast_model, "q8": bundled}[backend]
    assert whole.chain.shards[0].backend.name == backend
    split = load_local_model(split=k, backend=backend)
    assert np.array_equal(
        step_logits(split.chain, case["prompt_ids"], follow),
        step_logits(whole.chain, case["prompt_ids"], follow),
    )


def test_cached_decode_equals_full_recompute(
    fast_model: LocalModel, oracle: dict[str, Any]
) -> None:
    case = _cases(oracle)[2]
    follow = case["hf_greedy_ids"][:24]
    cached = step_logits(fast_model.chain, case["prompt_ids"], follow)
    full = recomputed_logits(fast_model.chain, case["prompt_ids"], follow)
    assert np.max(np.abs(cached - full)) < 1e-4


def test_batched_decode_of_four_sequences_gives_each_its_solo_tokens(
    fast_model: LocalModel, oracle: dict[str, Any]
) -> None:
    cases = _cases(oracle)
    prompts = [c["prompt_ids"] for c in cases]
    params = [
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=24, temperature=0.8, seed=11),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=12),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=40, repetition_penalty=1.2, seed=13),
    ]
    solo, batched = solo_and_batched_ids(fast_model, prompts, params)
    assert batched == solo
    assert solo[0] == cases[0]["hf_greedy_ids"][:24]


def test_stop_string_ends_generation(fast_model: LocalModel, oracle: dict[str, Any]) -> None:
    case = _cases(oracle)[0]
    g = generate(
        fast_model.chain,
        fast_model.tokenizer,
        case["prompt_ids"],
        SamplingParams(max_tokens=48, stop=(" is",)),
    )
    assert (g.text, g.finish_reason) == ("The capital of France", "stop")


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_truncated_copy_of_the_bundled_model_is_refused(tmp_path: Path, cut: float) -> None:
    src = bundled_model_path()
    dst = tmp_path / "cut.gguf"
    with src.open("rb") as f_in, dst.open("wb") as f_out:
        f_out.write(f_in.read(int(src.stat().st_size * cut)))
    with pytest.raises(ModelFileError, match=r"truncated|not a readable"):
        load_local_model(dst)


def test_corrupted_header_of_the_bundled_model_is_refused(tmp_path: Path) -> None:
    dst = tmp_path / "corrupt.gguf"
    shutil.copyfile(bundled_model_path(), dst)
    with dst.open("r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)  # tensor and kv counts
    with pytest.raises(ModelFileError):
        load_local_model(dst)


@pytest.mark.parametrize("split", ["1", "3"])
def test_cli_generate_json_gives_the_oracle_ids(split: str, oracle: dict[str, Any]) -> None:
    case = _cases(oracle)[0]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshnet.cli.main",
            "generate",
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "48",
            "--split",
            split,
            "--backend",
            "fast",
            "--messages",
            json.dumps(messages),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    out = json.loads(done.stdout)
    assert out["prompt_ids"] == case["prompt_ids"]
    assert out["ids"] == case["hf_greedy_ids"]
    assert out["text"] == "The capital of France is Paris."
    assert out["finish_reason"] == "stop"


def test_fast_logits_are_within_1e_3_of_the_reference(
    fast_model: LocalModel, reference: LocalModel, oracle: dict[str, Any]
) -> None:
    assert fast_model.chain.shards[0].backend.name == "fast"
    for case in _cases(oracle):
        follow = case["hf_greedy_ids"][:8]
        fast = step_logits(fast_model.chain, case["prompt_ids"], follow)
        ref = step_logits(reference.chain, case["prompt_ids"], follow)
        assert np.max(np.abs(fast - ref)) < 1e-3, case["name"]


@pytest.mark.parametrize("batch", [2, 8, 32])
def test_fast_logits_are_bit_identical_alone_and_in_a_batch(
    fast_model: LocalModel, oracle: dict[str, Any], batch: int
) -> None:
    from meshnet.backends.base import BatchEntry

    cases = _cases(oracle)
    target = cases[0]["prompt_ids"]
    others = [cases[(i % 3) + 1]["prompt_ids"][: 5 + 3 * i] for i in range(batch - 1)]
    shard = fast_model.chain.shards[0]

    def run(seqs: list[list[int]]) -> list[np.ndarray]:
        kvs = [shard.backend.new_kv() for _ in seqs]
        out = shard.forward(
            np.concatenate([np.asarray(s) for s in seqs]),
            [BatchEntry(kv, len(s)) for kv, s in zip(kvs, seqs, strict=True)],
        )
        rows = [out[0]]
        for step in range(3):
            ids = np.asarray([(31 * step + 17 * i) % 49000 for i in range(len(seqs))])
            rows.append(shard.forward(ids, [BatchEntry(kv, 1) for kv in kvs])[0])
        return rows

    for a, b in zip(run([target]), run([target, *others]), strict=True):
        assert np.array_equal(a, b)
