"""The native block (every row of a batch): the same math as the Python block path, and
calls that do not fit refused with ValueError before anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant
from meshnet.backends.base import BatchEntry
from meshnet.backends.fast import FastBackend
from meshnet.engine.local import load_local_model

native = pytest.importorskip("meshnet.backends._native")


@pytest.fixture(scope="module", params=[QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda q: q.name)
def backend(request, tiny_factory) -> FastBackend:  # type: ignore[no-untyped-def]
    path: Path = tiny_factory(f"blk{request.param.name}.gguf", matrix_type=request.param)
    b = load_local_model(path, backend="fast").chain.shards[0].backend
    assert isinstance(b, FastBackend) and b.runs_native_blocks
    return b


def _decode(backend: FastBackend, native_blocks: bool) -> np.ndarray:
    """Hidden states of 3 decode steps of two sequences after their prompts."""
    saved = backend._native
    if not native_blocks:
        backend._native = None  # every row through the Python block path
    try:
        rng = np.random.default_rng(0)
        d = backend.spec.d_model
        kvs = [backend.new_kv(), backend.new_kv()]
        backend.run_layers(
            rng.standard_normal((9, d)).astype(np.float32),
            [BatchEntry(kvs[0], 5), BatchEntry(kvs[1], 4)],
        )
        outs = [
            backend.run_layers(
                rng.standard_normal((2, d)).astype(np.float32),
                [BatchEntry(kvs[0], 1), BatchEntry(kvs[1], 1)],
            )
            for _ in range(3)
        ]
        return np.concatenate(outs)
    finally:
        backend._native = saved


def test_the_native_block_computes_what_the_python_block_does(backend: FastBackend) -> None:
    native_out, python_out = _decode(backend, True), _decode(backend, False)
    scale = np.abs(python_out).max()
    assert np.max(np.abs(native_out - python_out)) < 1e-4 * scale


def _entry(backend: FastBackend, layer: int, rows: int, row: int = 0) -> tuple:  # type: ignore[type-arg]
    kv = backend.new_kv()
    kv.reserve(rows)
    keys, values = kv.buffers(layer)
    return keys, values, 0, rows, row


def test_a_call_that_does_not_fit_writes_nothing(backend: FastBackend) -> None:
    handle = backend._native._handles[0]  # type: ignore[union-attr]
    d, pairs = backend.spec.d_model, backend.spec.rope.pairs
    x = np.ones((2, d), np.float32)
    cos, sin = np.ones((2, pairs), np.float32), np.zeros((2, pairs), np.float32)
    keys, values, *_ = entry = _entry(backend, 0, 2)
    calls = [
        (np.ones((2, d + 1), np.float32), cos, sin, [entry]),  # x not rows of d
        (x, cos[:1], sin[:1], [entry]),  # rotary tables for another batch
        (x, cos, sin, [(*entry[:3], 1, 0)]),  # the rows do not cover the batch
        (x, cos, sin, [(keys, values[:, :1], 0, 2, 0)]),  # keys and values differ
        (x, cos, sin, [(keys, values, keys.shape[1] - 1, 2, 0)]),  # past the cache
        (x, cos, sin, [(keys.astype(np.float64), values, 0, 2, 0)]),
    ]
    for args in calls:
        before = x.copy()
        with pytest.raises(ValueError):
            native.run_block(handle, *args, 1)
        assert np.array_equal(x, before)
        assert not keys.any() and not values.any()


def test_a_block_whose_matrices_do_not_fit_its_shape_is_refused(backend: FastBackend) -> None:
    s, w = backend.spec, backend.weights.blocks[0]
    assert len(w.qkv) == 1 and len(w.gate_up) == 1  # one block type: fused at load
    qkv, gate_up = quant.native_args(w.qkv[0]), quant.native_args(w.gate_up[0])
    wo, down = quant.native_args(w.wo), quant.native_args(w.w_down)
    assert w.w_down is not None
    vectors = (w.attn_norm, w.ffn_norm, None, None, None, None, None, None, None, None)
    shape = (s.rms_eps, s.n_heads, s.n_kv_heads, s.head_dim)
    sizes = (s.d_model, s.d_ff, s.rope.pairs)
    traits = (False, False, s.attn_scale, 0.0, 0)
    native.block((qkv,), wo, (gate_up,), down, vectors, *shape, *sizes, traits)  # fits
    with pytest.raises(ValueError):  # q/k/v and output swapped
        native.block((wo,), qkv, (gate_up,), down, vectors, *shape, *sizes, traits)
    with pytest.raises(ValueError):
        native.block(
            (qkv,), wo, (gate_up,), down, vectors, *shape, s.d_model, s.d_ff * 2, 4, traits
        )
    with pytest.raises(ValueError):  # two parts of a three-part projection
        native.block((qkv, qkv), wo, (gate_up,), down, vectors, *shape, *sizes, traits)
    with pytest.raises(ValueError):  # a bias of the wrong width
        bad = (*vectors[:2], np.zeros(3, np.float32), *vectors[3:])
        native.block((qkv,), wo, (gate_up,), down, bad, *shape, *sizes, traits)
    with pytest.raises(ValueError):  # a query norm without a key norm
        bad = (*vectors[:3], np.ones(s.head_dim, np.float32), *vectors[4:])
        native.block((qkv,), wo, (gate_up,), down, bad, *shape, *sizes, traits)
    with pytest.raises(ValueError):  # sinks of another head count
        bad = (*vectors[:8], np.zeros(s.n_heads + 1, np.float32), None)
        native.block((qkv,), wo, (gate_up,), down, bad, *shape, *sizes, traits)
    with pytest.raises(ValueError):  # a shared expert's gate without a mixture
        bad = (*vectors[:9], np.zeros(s.d_model, np.float32))
        native.block((qkv,), wo, (gate_up,), down, bad, *shape, *sizes, traits)
    with pytest.raises(ValueError):  # no feed-forward at all
        native.block((qkv,), wo, (), None, vectors, *shape, *sizes, traits)
    with pytest.raises(ValueError):  # an activation the kernels do not have
        native.block((qkv,), wo, (gate_up,), down, vectors, *shape, *sizes, (0, 3, 0.1, 0.0, 0))
    with pytest.raises(ValueError):  # a negative window
        native.block((qkv,), wo, (gate_up,), down, vectors, *shape, *sizes, (0, 0, 0.1, 0.0, -1))
    packed, rows, nb, kind = qkv
    with pytest.raises(ValueError):  # fewer bytes than the blocks claimed
        native.block(
            ((packed[:-1], rows, nb, kind),), wo, (gate_up,), down, vectors, *shape, *sizes, traits
        )
    with pytest.raises(ValueError):  # more rows than the groups hold
        native.block(
            ((packed, rows + 16, nb, kind),), wo, (gate_up,), down, vectors, *shape, *sizes, traits
        )


def test_elementwise_kernels_refuse_mismatched_buffers() -> None:
    x = np.zeros((2, 3, 8), np.float32)
    table = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError):
        native.rope(x, table, table, 2, 3, 8, 5)  # more pairs than a head has
    with pytest.raises(ValueError):
        native.rope(x, table[:1], table[:1], 2, 3, 8, 4)
    with pytest.raises(ValueError):
        native.glu(np.zeros((2, 16), np.float32), np.zeros((2, 7), np.float32), 2, 8, 1)


def test_a_block_gives_the_same_bits_at_both_vector_widths(backend: FastBackend) -> None:
    """Prompt rows then a decode row through one block with AVX2's 8-row matmul vectors
    and with the widest the CPU has (AVX-512's 16 where it has them), and again with the
    scratch already warm: the same bits every time."""
    handle = backend._native._handles[0]  # type: ignore[union-attr]
    d, pairs = backend.spec.d_model, backend.spec.rope.pairs
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((37, d)).astype(np.float32)
    step = rng.standard_normal((1, d)).astype(np.float32)
    angles = rng.uniform(-3, 3, (38, pairs)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    results = []
    for wide in (False, True, False, True):
        kv = backend.new_kv()
        kv.reserve(38)
        keys, values = kv.buffers(0)
        x0, x1 = prompt.copy(), step.copy()
        native.run_block(handle, x0, cos[:37], sin[:37], [(keys, values, 0, 37, 0)], 2, wide)
        native.run_block(handle, x1, cos[37:], sin[37:], [(keys, values, 37, 1, 0)], 2, wide)
        results.append(np.concatenate([x0, x1]))
    for other in results[1:]:
        assert np.array_equal(results[0], other)
