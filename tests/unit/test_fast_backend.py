"""The fast (quantized, numba) backend against the numpy reference, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from invariants import step_logits

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry
from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.model.sampling import SamplingParams

PROMPT = [5, 80, 99, 120, 7, 3, 200, 41]
FOLLOW = [17, 250, 3, 3, 90]


@pytest.mark.parametrize(
    "types",
    [
        dict(matrix_type=QT.Q4_0, embedding_type=QT.Q8_0),
        dict(matrix_type=QT.Q4_1, embedding_type=QT.Q4_1),
        dict(matrix_type=QT.Q8_0, embedding_type=QT.F16),
        dict(matrix_type=QT.F16, embedding_type=QT.Q4_0, tied_head=False),
        dict(matrix_type=QT.Q8_0, layer_types={1: QT.Q5_1, 2: QT.BF16}),
    ],
)
def test_fast_matches_the_reference(tiny_factory, types: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    path: Path = tiny_factory("mix.gguf", **types)
    fast = load_local_model(path, backend="fast")
    ref = load_local_model(path, backend="numpy")
    a = step_logits(fast.chain, PROMPT, FOLLOW)
    b = step_logits(ref.chain, PROMPT, FOLLOW)
    assert np.max(np.abs(a - b)) < 1e-3
    params = SamplingParams(max_tokens=12)
    assert (
        generate(fast.chain, fast.tokenizer, PROMPT, params).ids
        == generate(ref.chain, ref.tokenizer, PROMPT, params).ids
    )


@pytest.mark.skipif(quant.NATIVE is None, reason="the native kernels are not built")
def test_rows_take_the_native_blocks_where_the_layouts_allow(tiny_factory) -> None:  # type: ignore[no-untyped-def]
    for qtype in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.F16):  # every block type has native kernels
        model = load_local_model(tiny_factory(f"n{qtype.name}.gguf", matrix_type=qtype))
        assert all(s.backend.runs_native_blocks for s in model.chain.shards)


def _logits_in_batch(
    model: LocalModel, target: list[int], others: list[list[int]], decode_steps: int
) -> list[np.ndarray]:
    """The target's logits at prefill and each decode step, run among ``others``."""
    shard = model.chain.shards[0]
    seqs = [target, *others]
    kvs = [shard.backend.new_kv() for _ in seqs]
    out = shard.forward(
        np.concatenate([np.asarray(s) for s in seqs]),
        [BatchEntry(kv, len(s)) for kv, s in zip(kvs, seqs, strict=True)],
    )
    rows = [out[0]]
    for step in range(decode_steps):
        ids = np.asarray([(7 * step + 11 * i) % 250 for i in range(len(seqs))])
        out = shard.forward(ids, [BatchEntry(kv, 1) for kv in kvs])
        rows.append(out[0])
    return rows


@pytest.fixture(scope="module", params=["fast", "q8"])
def tiny_on(request: pytest.FixtureRequest, tiny_path: Path) -> LocalModel:
    """The tiny model on each quantized backend (q8: 8-bit activations, its own contract)."""
    return load_local_model(tiny_path, backend=request.param)


@pytest.mark.parametrize("batch", [2, 8, 32])
def test_a_sequences_logits_are_bit_identical_alone_and_batched(
    tiny_on: LocalModel, batch: int
) -> None:
    tiny = tiny_on
    rng = np.random.default_rng(batch)
    others = [rng.integers(3, 260, rng.integers(1, 20)).tolist() for _ in range(batch - 1)]
    alone = _logits_in_batch(tiny, PROMPT, [], 4)
    together = _logits_in_batch(tiny, PROMPT, others, 4)
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.skipif(quant.NATIVE is None, reason="the native kernels are not built")
@pytest.mark.parametrize("chunk", [1, 3, len(PROMPT)])
def test_a_prompt_gives_the_same_bits_in_one_chunk_in_several_or_token_by_token(
    tiny_on: LocalModel, chunk: int
) -> None:
    """Prompt rows meet the very kernels decode rows do, so how a prompt is chunked
    (the scheduler's choice, which depends on load) never changes a session's logits."""
    shard = tiny_on.chain.shards[0]

    def run(step: int) -> list[np.ndarray]:
        kv = shard.backend.new_kv()
        rows = []
        for start in range(0, len(PROMPT), step):
            part = PROMPT[start : start + step]
            rows.append(shard.forward(np.asarray(part), [BatchEntry(kv, len(part))])[0])
        for token in FOLLOW:
            rows.append(shard.forward(np.asarray([token]), [BatchEntry(kv, 1)])[0])
        return [rows[(len(PROMPT) - 1) // step], *rows[-len(FOLLOW) :]]

    whole = run(len(PROMPT))
    for a, b in zip(whole, run(chunk), strict=True):
        assert np.array_equal(a, b)


def test_a_step_looks_up_each_distinct_rope_once(tiny: LocalModel, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every layer of the tiny model rotates alike: one table lookup a step, not one a
    layer (each cost a step ~26 us a layer)."""
    from meshnet.model.rope import RopeTables

    calls: list[int] = []
    real = RopeTables.at

    def counted(self: RopeTables, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls.append(len(positions))
        return real(self, positions)

    monkeypatch.setattr(RopeTables, "at", counted)
    shard = tiny.chain.shards[0]
    assert shard.spec.n_layers > 1
    kv = shard.backend.new_kv()
    shard.forward(np.asarray(PROMPT), [BatchEntry(kv, len(PROMPT))])
    assert calls == [len(PROMPT)]


@pytest.mark.parametrize("backend", ["fast", "q8"])
def test_without_the_native_kernels_the_numba_kernels_serve_the_same_tokens(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Where the extension is not built (here: as if it were not), the matrices keep
    their GGUF blocks and rows go through the numba kernels, loaded on first use: the
    reference's logits and tokens, a sequence's bits the same alone and batched."""
    monkeypatch.setattr(quant, "NATIVE", None)
    model = load_local_model(tiny_path, backend=backend)
    ref = load_local_model(tiny_path, backend="numpy")
    assert quant.kernel_name() == "numba"
    assert not any(s.backend.runs_native_blocks for s in model.chain.shards)
    a = step_logits(model.chain, PROMPT, FOLLOW)
    assert np.max(np.abs(a - step_logits(ref.chain, PROMPT, FOLLOW))) < 1e-3
    params = SamplingParams(max_tokens=12)
    ids = generate(model.chain, model.tokenizer, PROMPT, params).ids
    assert ids == generate(ref.chain, ref.tokenizer, PROMPT, params).ids
    others = [[9, 8, 7], [100, 101, 102, 103, 104]]
    alone = _logits_in_batch(model, PROMPT, [], 3)
    for x, y in zip(alone, _logits_in_batch(model, PROMPT, others, 3), strict=True):
        assert np.array_equal(x, y)
