"""A matrix's row range (``quant.row_range``), as a head split between two nodes takes
it: its product is bit-for-bit those columns of the whole matrix's product, in every
layout and at either vector width, and ranges off the row groups are refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from kquants import quantize as k_quantize

from meshnet.backends import quant

COLS = 512
ROWS = 100  # not a whole number of row groups: the last group is padded


def _raw(qtype: QT, rows: int) -> np.ndarray:
    data = np.random.default_rng(3).standard_normal((rows, COLS)).astype(np.float32) * 0.2
    if qtype == QT.F32:
        return data.view(np.uint8)
    if qtype in (QT.Q4_K, QT.Q6_K):
        return k_quantize(data, qtype)
    return gguf.quants.quantize(data, qtype)


LAYOUTS = [
    pytest.param(dict(native=False), id="blocks"),
    pytest.param(dict(), id="native"),
    pytest.param(dict(q8=True), id="q8"),
]


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.F32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("wide", [True, False])
def test_a_row_range_multiplies_to_those_columns_of_the_whole(
    qtype: QT, layout: dict[str, bool], wide: bool
) -> None:
    if layout.get("native", True) is not False and quant.NATIVE is None:
        pytest.skip("the native kernels are not built")
    if not wide and quant.NATIVE is None:
        pytest.skip("the vector width is the native kernels'")
    w = quant.from_blocks(_raw(qtype, ROWS), qtype, (ROWS, COLS), **layout)
    x = np.random.default_rng(4).standard_normal((3, COLS)).astype(np.float32)
    whole = quant.matmul(x, w, wide=wide)
    for start, stop in [(0, 48), (48, ROWS), (16, 32), (0, ROWS), (96, ROWS)]:
        part = quant.matmul(x, quant.row_range(w, start, stop), wide=wide)
        assert part.shape == (3, stop - start)
        np.testing.assert_array_equal(part, whole[:, start:stop])


def test_a_row_range_shares_the_matrix_memory() -> None:
    w = quant.from_blocks(_raw(QT.Q6_K, ROWS), QT.Q6_K, (ROWS, COLS), q8=True)
    part = quant.row_range(w, 32, ROWS)
    assert np.shares_memory(part.data, w.data)


@pytest.mark.parametrize("start, stop", [(-1, 16), (16, 16), (0, ROWS + 1), (8, 32), (0, 40)])
def test_a_range_outside_the_matrix_or_off_its_row_groups_is_refused(start: int, stop: int) -> None:
    if quant.NATIVE is None and (start, stop) in ((8, 32), (0, 40)):
        pytest.skip("GGUF blocks have no row groups")
    w = quant.from_blocks(_raw(QT.Q8_0, ROWS), QT.Q8_0, (ROWS, COLS))
    with pytest.raises(ValueError):
        quant.row_range(w, start, stop)
