"""The q8 matmul's bits pinned: for each type, the outputs of seeded matrices and inputs
at one token and in every batch tile width, at both vector widths, hash to what the
kernels computed before their T=1 K-quant tiles were reworked (commit fc5d94b). The
kernels' integer sums may be split and ordered freely, their float operations per
(row, token) may not (q8_tile.h): a change that moves one bit of one logit fails here,
where the tolerance tests (test_q8_kernels.py) would pass it."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from kquants import quantize as k_quantize

from meshnet.backends import quant

pytestmark = pytest.mark.skipif(quant.NATIVE is None, reason="the native kernels are not built")

K_BLOCK = {QT.Q4_K: (144, (0, 2)), QT.Q5_K: (176, (0, 2)), QT.Q6_K: (210, (208,))}
BATCHES = (1, 2, 3, 4, 5, 8, 9, 12, 13)  # every tile width of both ISAs, and a remainder

PINNED = {
    QT.Q4_0: "9576b8f1339b0d5f3e77f326fc58369ba45f2a0f69a68651cfa1772c35f23a7b",
    QT.Q4_1: "2a53609f2b277a065a8605057b3c59542df3b34b25f07964ab60ee4cc7f608e8",
    QT.Q8_0: "83769c85861e55b2b957d4485f9ad209ecf9842964721ec81e387296e9b7c121",
    QT.Q5_0: "6bd4134d8c4357036b7c5bd96ecaa88ede3d00e67b3574f837f6f7fb086eb96a",
    QT.Q5_1: "d379d022be1c6ed7d02722c5db294af7f7718afec8b5072a981bcce95450215b",
    QT.Q4_K: "99a42ffe6a835dac45da93c5801e6eb9d05e24b3daf6339d873f1faf7f77bcfc",
    QT.Q5_K: "c679ab87b20aa878f832d95c1685aa47ec3ac376e8c437ffe4265cc6757dcf8a",
    QT.Q6_K: "dcca8825de64e0ac3f8be07f81605e64a801b065d7d0d22c4cee147c6071ac72",
}


def _quantized(qtype: QT, rows: int, cols: int) -> np.ndarray:
    """A Gaussian matrix's GGUF blocks, as a quantizer writes them."""
    data = np.random.default_rng(11).standard_normal((rows, cols)).astype(np.float32) * 0.2
    if qtype in K_BLOCK:
        return k_quantize(data, qtype)
    return gguf.quants.quantize(data, qtype)


def _random_bytes(qtype: QT, rows: int, cols: int) -> np.ndarray:
    """K-quant blocks of random bytes (every scale, min and quant up to its largest),
    the float16 fields set: the integer sums' widest range."""
    size, halves = K_BLOCK[qtype]
    raw = np.random.default_rng(12).integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for i, at in enumerate(halves):
        raw[:, at : at + 2] = np.frombuffer(np.float16(0.03 / (i + 1)).tobytes(), np.uint8)
    return raw.reshape(-1)


def _inputs(cols: int) -> np.ndarray:
    """Gaussian rows, then rows of +-1 (every 8-bit quant at +-127)."""
    rng = np.random.default_rng(13)
    gauss = rng.standard_normal((13, cols)).astype(np.float32)
    signs = np.where(rng.random((13, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
    return np.concatenate([gauss, signs])


def _digest(qtype: QT) -> str:
    h = hashlib.sha256()
    cases = [(_quantized(qtype, 61, 768), 61, 768)]  # whole and partial row groups
    if qtype in K_BLOCK:
        cases.append((_random_bytes(qtype, 40, 512), 40, 512))
    for raw, rows, cols in cases:
        w = quant.from_blocks(raw, qtype, (rows, cols), q8=True)
        assert w.q8
        packed, _, nb, code = quant.native_args(w)
        x = _inputs(cols)
        for first in (0, 13):  # Gaussian inputs, then the +-1 ones
            for batch in BATCHES:
                outs = []
                for wide in (False, True):
                    out = np.empty((batch, rows), np.float32)
                    xs = np.ascontiguousarray(x[first : first + batch])
                    quant.NATIVE.matmul(packed, xs, out, rows, nb, batch, code, 1, wide)
                    outs.append(out)
                assert np.array_equal(outs[0], outs[1]), (batch, "AVX2 and AVX-512 differ")
                h.update(outs[0].tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("qtype", list(PINNED), ids=lambda q: q.name)
def test_q8_matmul_bits_are_the_pinned_ones(qtype: QT) -> None:
    assert _digest(qtype) == PINNED[qtype]
