"""The native mixture of experts: a handle on a layer's router and experts is built only
from matrices and biases that fit; a call that does not fit is refused with ValueError."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry
from meshnet.backends.fast import FastBackend
from meshnet.engine.local import load_local_model
from meshnet.model.weights import ExpertWeights

native = pytest.importorskip("meshnet.backends._native")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "quant" / "qwen3moe-q4km.gguf"


@pytest.fixture(scope="module")
def backend() -> FastBackend:
    b = load_local_model(FIXTURE, backend="fast").chain.shards[0].backend
    assert isinstance(b, FastBackend) and b.runs_native_blocks
    return b


def _args(b: FastBackend, w: ExpertWeights, **change: object) -> tuple[object, ...]:
    assert b.spec.experts is not None
    args = {
        "router": quant.native_args(w.router),
        "router_bias": None,
        "gate_ups": tuple(tuple(quant.native_args(m) for m in parts) for parts in w.gate_up),
        "downs": tuple(quant.native_args(m) for m in w.down),
        "biases": (None, None, None),
        "d": b.spec.d_model,
        "d_ff": b.spec.experts.d_ff,
        "n_used": b.spec.experts.n_used,
        "gating": 0,
        "normalize": 1,
        "act": 0,
    }
    args.update(change)
    return tuple(args.values())


def test_experts_that_do_not_fit_are_refused(backend: FastBackend) -> None:
    w = backend.weights.blocks[0].experts
    assert w is not None
    native.experts(*_args(backend, w))  # fits
    n = len(w.down)
    refused = [
        {"n_used": n + 1},  # more used than there are
        {"n_used": 0},
        {"downs": tuple(quant.native_args(m) for m in w.down[:-1])},  # one expert short
        {"router": quant.native_args(w.down[0])},  # a down matrix as the router
        {"router_bias": np.zeros(n + 1, np.float32)},
        {"biases": (np.zeros((n, 3), np.float32), None, None)},  # a gate bias alone, too short
        {"d_ff": backend.spec.experts.d_ff * 2},  # type: ignore[union-attr]
        {"gating": 2},
        {"act": 7},
    ]
    for change in refused:
        with pytest.raises(ValueError):
            native.experts(*_args(backend, w, **change))


def test_a_block_of_experts_gives_each_row_its_own_result(backend: FastBackend) -> None:
    """Rows routed to overlapping experts give the bits each gives alone."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, backend.spec.d_model)).astype(np.float32)
    together = backend.run_layers(rows, [BatchEntry(backend.new_kv(), 1) for _ in range(6)])
    for i in range(6):
        alone = backend.run_layers(rows[i : i + 1], [BatchEntry(backend.new_kv(), 1)])
        assert np.array_equal(alone[0], together[i])


def test_a_layers_experts_share_one_run_of_pages_and_multiply_as_apart() -> None:
    """share_pages lays matrices end to end (2 MB pages for the run) without changing a
    product: each matrix is a view of its own bytes."""
    w = load_local_model(FIXTURE, backend="q8").chain.shards[0].backend.weights.blocks[0]
    assert w.experts is not None
    downs = w.experts.down

    def laid_end_to_end(mats: tuple) -> bool:  # type: ignore[type-arg]
        ends = [m.data.ctypes.data + m.data.nbytes for m in mats[:-1]]
        return ends == [m.data.ctypes.data for m in mats[1:]]

    assert laid_end_to_end(downs)
    apart = tuple(replace(m, data=m.data.copy()) for m in downs)
    shared = quant.share_pages(apart)
    x = np.random.default_rng(1).standard_normal((3, downs[0].cols)).astype(np.float32)
    assert laid_end_to_end(shared)
    for a, s in zip(apart, shared, strict=True):
        assert np.array_equal(quant.matmul(x, a), quant.matmul(x, s))
