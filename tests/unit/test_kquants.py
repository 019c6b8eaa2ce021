"""The tests' K-quant encoder writes real GGUF blocks, and models made of them run on
the fast backend as on the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from invariants import step_logits
from kquants import quantize

from meshnet.engine.local import load_local_model

# Relative RMS error of a simple min/max choice of scales on normal data, per type.
ERROR = {QT.Q2_K: 0.40, QT.Q3_K: 0.22, QT.Q4_K: 0.10, QT.Q5_K: 0.05, QT.Q6_K: 0.03}


@pytest.mark.parametrize("qtype", list(ERROR), ids=lambda q: q.name)
def test_blocks_round_trip_through_gguf_dequantize(qtype: QT) -> None:
    data = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    data[0] = 0.0  # an all-zero row: zero scales, no division by zero
    data[1] = np.abs(data[1]) + 1.0  # all positive: no offset to take
    raw = quantize(data, qtype)
    assert raw.shape == (6, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(raw, qtype).reshape(data.shape)
    assert np.array_equal(back[0], data[0])
    rms = np.sqrt(np.mean((back - data) ** 2, axis=1))
    assert np.all(rms[1:] <= ERROR[qtype] * np.sqrt(np.mean(data[1:] ** 2, axis=1)))


def test_a_width_not_of_super_blocks_is_refused() -> None:
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 128), np.float32), QT.Q4_K)


@pytest.mark.parametrize(
    "types",
    [
        dict(matrix_type=QT.Q4_K, embedding_type=QT.Q6_K, layer_types={1: QT.Q5_K}),
        dict(matrix_type=QT.Q3_K, embedding_type=QT.Q2_K, tied_head=False),
    ],
)
def test_a_k_quant_model_runs_as_on_the_reference(tiny_factory, types: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    path = tiny_factory("kq.gguf", d_model=256, d_ff=512, n_layers=2, **types)
    fast = load_local_model(path, backend="fast")
    ref = load_local_model(path, backend="numpy")
    prompt, follow = [5, 80, 99, 120, 7], [17, 250, 3]
    a = step_logits(fast.chain, prompt, follow)
    b = step_logits(ref.chain, prompt, follow)
    assert np.max(np.abs(a - b)) < 1e-3
