"""Matrices kept in their GGUF quantized blocks, and the kernels that multiply from them.

A decode step reads the weights in their own bits (~4.5-6.5 per weight for the common
quantizations) instead of 32. Every output element ``y[t, r] = W[r] . x[t]`` is computed
by the same loop, in the same order, whatever the number of rows ``t`` in the batch or
how rows ``r`` are split among threads, so a sequence's results are bit-identical alone
or batched.

Where the native extension is built (``NATIVE``), a matrix holds only its native layout
(``quant_layouts``), made once at load from the tensor's bytes read off the file; every
block type is multiplied, and its embedding rows gathered, from it. Elsewhere a matrix
holds the GGUF's blocks: the numba kernels (``quant_numba``) multiply Q4_0, Q4_1 and
Q8_0 straight from them and any other type a dequantized chunk of rows at a time. numba
is imported by the first such multiply, never where every matrix is native
(``kernel_threads``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant_layouts as layouts
from meshnet.backends.kernel_threads import kernel_threads, numba_threads
from meshnet.errors import UnsupportedTensorType
from meshnet.memory import on_huge_pages
from meshnet.model.gguf_file import GGUFFile

F32 = np.float32
QK = layouts.QK
_CHUNK_ROWS = 256  # rows dequantized at a time by the numba path's float32 matmul

try:  # AVX2/AVX-512 kernels built by `pip install` where a compiler and the CPU allow
    from meshnet.backends import _native

    NATIVE = _native
except ImportError:
    NATIVE = None  # type: ignore[assignment]  # not built; no type spells "a module or None"


def kernel_name() -> str:
    """Which kernels multiply quantized blocks in this process: "avx512" or "avx2" (the
    native matmul's vectors; ``MESHNET_ISA=avx2`` keeps an AVX-512 CPU to AVX2), or
    "numba" where the extension is not built."""
    return NATIVE.isa() if NATIVE is not None else "numba"


class Split(NamedTuple):
    """A Q4_0, Q4_1 or Q8_0 matrix as the numba kernels read it."""

    qs: np.ndarray  # quants (4-bit: uint8 [rows, cols / 2], Q8_0: int8 [rows, cols])
    d: np.ndarray  # float32 [rows, nb] block scales
    m: np.ndarray  # float32 [rows, nb] block offsets (4-bit only; Q4_0: -8 d)


@dataclass(frozen=True)
class QuantMatrix:
    """A [rows, cols] weight matrix of GGUF block type ``qtype``.

    ``data`` is the native kernels' layout of it where ``native`` (see
    ``quant_layouts``), else the GGUF's own blocks, uint8 [rows, bytes per row]. ``q8``:
    that layout's q8 variant, multiplied with 8-bit activations (the q8 backend).
    """

    qtype: QT
    rows: int
    cols: int
    data: np.ndarray
    native: bool
    q8: bool = False

    @property
    def kind(self) -> str:
        """The block type's name in lower case: "q4_k", "q8_0", "f32"..."""
        return self.qtype.name.lower()

    @cached_property
    def split(self) -> Split:
        """The GGUF blocks of a Q4_0, Q4_1 or Q8_0 matrix as quants, float32 scales and
        offsets (the numba path; made on first use)."""
        if self.native or self.qtype not in (QT.Q4_0, QT.Q4_1, QT.Q8_0):
            raise ValueError("only Q4_0, Q4_1 and Q8_0 blocks split for the numba kernels")
        nb = self.cols // QK
        size = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}[self.qtype]
        blocks = np.asarray(self.data, np.uint8).reshape(self.rows, nb, size)
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(F32)
        if self.qtype == QT.Q8_0:
            q8 = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(self.rows, -1)
            return Split(q8, d, np.empty((0, 0), F32))
        if self.qtype == QT.Q4_1:
            m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(F32)
        else:
            m = (d * F32(-8.0)).astype(F32)
        qs = np.ascontiguousarray(blocks[:, :, -16:]).reshape(self.rows, -1)
        return Split(qs, d, m)


def from_gguf(
    f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int], q8: bool = False
) -> QuantMatrix:
    """A GGUF 2-D tensor of ``shape`` for the kernels, its bytes read off the file (not
    through the memory map, whose pages would stay counted in this process's memory);
    ``q8``: in the q8 layout where its type has a q8 kernel (see ``from_blocks``)."""
    try:
        qtype = QT(t.tensor_type)
    except ValueError as e:
        raise UnsupportedTensorType(f"tensor {t.name!r} has an unknown type") from e
    return from_blocks(f.read_tensor(t), qtype, shape, name=t.name, q8=q8)


def from_gguf_q8(f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int]) -> QuantMatrix:
    """``from_gguf`` for the q8 backend."""
    return from_gguf(f, t, shape, q8=True)


def from_blocks(
    raw: np.ndarray,
    qtype: QT,
    shape: tuple[int, int],
    native: bool | None = None,
    name: str = "matrix",
    q8: bool = False,
) -> QuantMatrix:
    """A matrix from its GGUF bytes: in the native layout (``raw`` is then dropped by the
    caller) where the extension is built, unless ``native`` is False, else kept as blocks.
    With ``q8``, a native matrix of a type with a q8 kernel takes the q8 layout (other
    types, and a Q8_0 matrix holding a -128 quant, keep the float32-activation one).

    ``UnsupportedTensorType`` when the kernels have no reading of ``qtype`` or the width
    is not a whole number of its blocks (K-quants: super-blocks of 256).
    """
    rows, cols = shape
    if qtype not in layouts.CODES:
        raise UnsupportedTensorType(f"{name}: the kernels do not read {qtype.name} blocks")
    unit = layouts.width_unit(qtype)
    if cols % unit or cols == 0:
        raise UnsupportedTensorType(
            f"{name}: {qtype.name} rows of {cols} weights are not whole blocks of {unit}"
        )
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.asarray(raw).view(np.uint8).reshape(-1)
    if raw.size != rows * cols // block * size:
        raise UnsupportedTensorType(f"{name}: {raw.size} bytes do not hold {shape} {qtype.name}")
    use_native = NATIVE is not None if native is None else native and NATIVE is not None
    if use_native:
        packed = layouts.pack(raw, qtype, rows, cols)
        interleaved = layouts.q8_layout(packed, qtype) if q8 else None
        if interleaved is not None:
            return QuantMatrix(qtype, rows, cols, on_huge_pages(interleaved), True, q8=True)
        return QuantMatrix(qtype, rows, cols, on_huge_pages(packed), True)
    return QuantMatrix(qtype, rows, cols, raw.reshape(rows, -1), False)


def stack_rows(parts: list[QuantMatrix]) -> QuantMatrix:
    """One matrix of the parts' rows in order (fused Q/K/V or gate/up).

    ``ValueError`` unless the parts share block type, width and layout and, in a
    row-group layout, every part but the last fills whole groups of 16 rows.
    """
    first = parts[0]
    if len({(p.qtype, p.cols, p.native, p.q8) for p in parts}) != 1:
        raise ValueError("only matrices of one block type, width and layout can be fused")
    grouped = first.native and first.qtype in layouts.LEGACY | layouts.KQUANTS
    if grouped and any(p.rows % layouts.GROUP_ROWS for p in parts[:-1]):
        raise ValueError("row groups of 16 can be fused only after whole groups")
    data = np.concatenate([p.data for p in parts])
    return QuantMatrix(
        first.qtype,
        sum(p.rows for p in parts),
        first.cols,
        on_huge_pages(data) if first.native else data,
        first.native,
        first.q8,
    )


def share_pages(mats: tuple[QuantMatrix, ...]) -> tuple[QuantMatrix, ...]:
    """The matrices with their bytes laid end to end in one buffer that may take 2 MB pages
    (``on_huge_pages``), each a view of its part: a mixture's experts are each smaller than
    one such page, so apart they would stream through 4 KB pages (a TLB miss every 4 KB).
    Matrices outside the native layout are returned as they are."""
    if not mats or not all(m.native for m in mats):
        return mats
    whole = on_huge_pages(np.concatenate([m.data.reshape(-1) for m in mats]))
    out, start = [], 0
    for m in mats:
        size = m.data.size
        out.append(replace(m, data=whole[start : start + size].reshape(m.data.shape)))
        start += size
    return tuple(out)


def row_range(w: QuantMatrix, start: int, stop: int) -> QuantMatrix:
    """Rows ``[start, stop)`` of ``w``, sharing its memory: ``matmul`` of it gives exactly
    those columns of ``matmul`` of the whole (a row's dot never depends on the others).

    ``ValueError`` unless ``0 <= start < stop <= w.rows`` and, in a row-group layout,
    ``start`` and ``stop`` (unless it is the end) fall on groups of 16 rows.
    """
    if not 0 <= start < stop <= w.rows:
        raise ValueError(f"rows [{start}, {stop}) of a matrix of {w.rows}")
    grouped = w.native and w.qtype in layouts.LEGACY | layouts.KQUANTS
    if not grouped:
        per_row = w.data.size // w.rows
        data = w.data.reshape(w.rows, per_row)[start:stop]
        return replace(w, rows=stop - start, data=data if not w.native else data.reshape(-1))
    g = layouts.GROUP_ROWS
    if start % g or (stop % g and stop != w.rows):
        raise ValueError(f"rows [{start}, {stop}) do not fall on groups of {g}")
    per_group = w.data.size // -(-w.rows // g)
    end = -(-stop // g) * per_group
    return replace(w, rows=stop - start, data=w.data[start // g * per_group : end])


def dequantize_all(w: QuantMatrix) -> np.ndarray:
    """The whole matrix as float32 [rows, cols] (for many-row matmuls through BLAS)."""
    return dequantize_rows(w, np.arange(w.rows, dtype=np.int64))


def dequantize_rows(w: QuantMatrix, ids: np.ndarray) -> np.ndarray:
    """Float32 rows ``ids`` of ``w`` (the embedding lookup): [len(ids), cols], as
    gguf-py's dequantize gives them."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if w.native:
        out = np.empty((len(ids), w.cols), F32)
        NATIVE.rows(w.data, ids, out, w.rows, w.cols // QK, native_args(w)[3])
        return out
    dense = gguf.quants.dequantize(w.data[ids], w.qtype)
    return np.ascontiguousarray(dense, dtype=F32).reshape(len(ids), w.cols)


def matmul(x: np.ndarray, w: QuantMatrix, native: bool = True, wide: bool = True) -> np.ndarray:
    """``x @ w.T`` for x [T, cols] float32 -> [T, rows] float32.

    A matrix in the native layout is multiplied by the native kernels (``native=False``
    is then refused: the numba kernels read the GGUF blocks, which it no longer holds);
    ``wide=False`` keeps them to AVX2's 8-row vectors (the same results).
    """
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.empty((x.shape[0], w.rows), F32)
    if w.native:
        if not native:
            raise ValueError("a matrix in the native layout has no numba kernel")
        packed, rows, nb, code = native_args(w)
        NATIVE.matmul(packed, x, out, rows, nb, x.shape[0], code, kernel_threads(), wide)
        return out
    numba_threads()  # numba loaded (the first time), its count on this thread the process's
    from meshnet.backends import quant_numba as nb_kernels

    if w.qtype in (QT.Q4_0, QT.Q4_1):
        qs, d, m = w.split
        nb_kernels.matmul_q4(qs, d, m, x, nb_kernels.block_sums(x), out)
    elif w.qtype == QT.Q8_0:
        qs, d, _ = w.split
        nb_kernels.matmul_q8(qs, d, x, out)
    else:
        for start in range(0, w.rows, _CHUNK_ROWS):
            ids = np.arange(start, min(start + _CHUNK_ROWS, w.rows), dtype=np.int64)
            part = np.empty((x.shape[0], len(ids)), F32)
            nb_kernels.matmul_f32(dequantize_rows(w, ids), x, part)
            out[:, start : start + len(ids)] = part
    return out


def native_args(w: QuantMatrix) -> tuple[np.ndarray, int, int, int]:
    """``w`` as the native kernels take a matrix: (packed, rows, nb, type code), the code
    with ``Q8_LAYOUT`` set for the q8 layout."""
    if not w.native:
        raise ValueError("the matrix is not in the native layout")
    code = layouts.CODES[w.qtype] | (layouts.Q8_LAYOUT if w.q8 else 0)
    return w.data, w.rows, w.cols // QK, code
