"""The native kernels' matrix layouts (``native/native.h``), made once from GGUF blocks.

Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, MXFP4 and the K-quants (Q4_K, Q5_K, Q6_K) are repacked
into groups of 16 rows whose fields are stored column by column, one byte (or float16)
per row, so a vector load gives one column of 8 or 16 rows. The other types (Q2_K, Q3_K,
F16, BF16, F32) keep the GGUF's own rows: their kernel unpacks a tile at a time.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

QK = 32  # weights per block; a matrix's width is nb * QK in every type
QK_K = 256  # weights per K-quant super-block
GROUP_ROWS = 16  # rows per group of the row-group layouts
_CHUNK_GROUPS = 64  # K-quant row groups repacked at a time

# The native kernels' number for each type they multiply, as in native/native.h.
CODES = {
    QT.Q4_0: 0,
    QT.Q4_1: 1,
    QT.Q8_0: 2,
    QT.Q4_K: 3,
    QT.Q5_K: 4,
    QT.Q6_K: 5,
    QT.Q2_K: 6,
    QT.Q3_K: 7,
    QT.Q5_0: 8,
    QT.Q5_1: 9,
    QT.F16: 10,
    QT.BF16: 11,
    QT.F32: 12,
    QT.MXFP4: 13,
}
LEGACY = frozenset({QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.MXFP4})  # per block
KQUANTS = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})  # row groups per super-block
SUPER_BLOCKED = frozenset({QT.Q2_K, QT.Q3_K, *KQUANTS})  # widths a multiple of 256


def width_unit(qtype: QT) -> int:
    """The columns a matrix of ``qtype`` must be a whole number of for the kernels."""
    return QK_K if qtype in SUPER_BLOCKED else QK


def pack(raw: np.ndarray, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """GGUF blocks (uint8, ``rows`` rows of ``cols`` weights) in the native layout of
    ``qtype``: a fresh uint8 array for the row-group types, ``raw`` itself (flat) for the
    row-wise ones."""
    raw = np.asarray(raw, np.uint8)
    if qtype in LEGACY:
        return _pack_legacy(raw, qtype, rows, cols // QK)
    if qtype in KQUANTS:
        return _pack_kquant(raw, qtype, rows, cols // QK_K)
    return raw.reshape(-1)


# The q8 layout (native.h): per row group and block (or super-block), the byte offset and
# the number of byte columns of each quant region regrouped four columns a row at a time,
# and (Q5_0, Q5_1) the offset of the fifth bits re-encoded as Q5_K's.
Q8_LAYOUT = 32  # or'ed into a type's code
Q8_REGIONS = {
    QT.Q4_0: ((2 * GROUP_ROWS, 16),),
    QT.Q4_1: ((4 * GROUP_ROWS, 16),),
    QT.Q8_0: ((2 * GROUP_ROWS, 32),),
    QT.Q5_0: ((2 * GROUP_ROWS, 16),),
    QT.Q5_1: ((4 * GROUP_ROWS, 16),),
    QT.MXFP4: ((GROUP_ROWS, 16),),
    QT.Q4_K: ((16 * GROUP_ROWS, 128),),
    QT.Q5_K: ((16 * GROUP_ROWS, 32), (48 * GROUP_ROWS, 128)),
    QT.Q6_K: ((18 * GROUP_ROWS, 192),),
}
_FIFTH_BITS = {QT.Q5_0: 18 * GROUP_ROWS, QT.Q5_1: 20 * GROUP_ROWS}
_GROUP_BYTES = {
    QT.Q4_0: 288,
    QT.Q4_1: 320,
    QT.Q8_0: 544,
    QT.Q5_0: 352,
    QT.Q5_1: 384,
    QT.MXFP4: 272,
    QT.Q4_K: 2304,
    QT.Q5_K: 2816,
    QT.Q6_K: 3360,
}


def q8_layout(packed: np.ndarray, qtype: QT) -> np.ndarray | None:
    """A matrix packed by ``pack`` in the q8 layout (in place), or None where its type has
    no q8 kernel or, for Q8_0, a quant is -128 (the AVX2 kernel's sign trick cannot take
    it; llama.cpp's quantizer never writes it)."""
    if qtype not in Q8_REGIONS:
        return None
    units = packed.reshape(-1, _GROUP_BYTES[qtype])
    if qtype == QT.Q8_0 and np.any(units[:, 2 * GROUP_ROWS :] == 0x80):
        return None
    for start, ncols in Q8_REGIONS[qtype]:
        region = units[:, start : start + ncols * GROUP_ROWS]
        tiles = region.reshape(-1, ncols // 4, 4, GROUP_ROWS).transpose(0, 1, 3, 2)
        units[:, start : start + ncols * GROUP_ROWS] = tiles.reshape(len(units), -1)
    if qtype in _FIFTH_BITS:
        start = _FIFTH_BITS[qtype]
        qh = units[:, start : start + 4 * GROUP_ROWS].reshape(-1, 4, GROUP_ROWS)  # [u, byte, row]
        bits = np.unpackbits(qh.transpose(0, 2, 1), axis=-1, bitorder="little")  # column c at c
        quads = bits.reshape(-1, GROUP_ROWS, 8, 4)  # column 4 m + b at [m, b]
        shifts = np.arange(8, dtype=np.uint8).reshape(8, 1)
        encoded = np.bitwise_or.reduce(quads << shifts, axis=-2)  # byte b: columns b + 4 m
        units[:, start : start + 4 * GROUP_ROWS] = encoded.reshape(len(units), -1)
    return packed


def _by_group(raw: np.ndarray, rows: int, units: int, size: int) -> np.ndarray:
    """Blocks [rows, units, size] as [groups, units, 16 rows, size], padded with zeros."""
    groups = -(-rows // GROUP_ROWS)
    blocks = np.zeros((groups * GROUP_ROWS, units, size), np.uint8)
    blocks[:rows] = raw.reshape(rows, units, size)
    return blocks.reshape(groups, GROUP_ROWS, units, size).transpose(0, 2, 1, 3)


def _columns(fields: np.ndarray) -> np.ndarray:
    """Per-row byte fields [g, u, 16, n] as n columns of 16 rows: [g, u, n * 16]."""
    g, u = fields.shape[:2]
    return fields.transpose(0, 1, 3, 2).reshape(g, u, -1)


def _rows_of(fields: np.ndarray) -> np.ndarray:
    """Per-row fields [g, u, 16, n] row after row: [g, u, 16 * n] (float16 scales)."""
    g, u = fields.shape[:2]
    return fields.reshape(g, u, -1)


def _pack_legacy(raw: np.ndarray, qtype: QT, rows: int, nb: int) -> np.ndarray:
    """Per group and block: the rows' float16 d, Q4_1's and Q5_1's float16 m, then the
    quants column by column, one byte per row (Q5_0, Q5_1: the 16 nibble columns, then
    the 4 bytes of fifth bits). MXFP4: the rows' exponent bytes, then its 16 columns."""
    by = _by_group(raw, rows, nb, _BLOCK_BYTES[qtype])
    if qtype == QT.MXFP4:
        parts = [_rows_of(by[..., :1]), _columns(by[..., 1:])]
        return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)
    halves = 4 if qtype in (QT.Q4_1, QT.Q5_1) else 2  # bytes of float16 fields first
    parts = [_rows_of(by[..., h : h + 2]) for h in range(0, halves, 2)]
    if qtype in (QT.Q5_0, QT.Q5_1):  # GGUF: the fifth bits (4 bytes) before the nibbles
        parts += [_columns(by[..., halves + 4 :]), _columns(by[..., halves : halves + 4])]
    else:
        parts.append(_columns(by[..., halves:]))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


_BLOCK_BYTES = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34, QT.Q5_0: 22, QT.Q5_1: 24, QT.MXFP4: 17}


def _pack_kquant(raw: np.ndarray, qtype: QT, rows: int, supers: int) -> np.ndarray:
    """Per group and super-block, native.h's K-quant fields, a few groups at a time (the
    unpacked quants of a whole embedding would take a byte per weight)."""
    size = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}[qtype]
    raw = raw.reshape(rows, supers * size)
    step = _CHUNK_GROUPS * GROUP_ROWS
    chunks = [
        _pack_kquant_rows(raw[r : r + step], qtype, min(step, rows - r), supers, size)
        for r in range(0, rows, step)
    ]
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def _pack_kquant_rows(raw: np.ndarray, qtype: QT, rows: int, supers: int, size: int) -> np.ndarray:
    """Q4_K/Q5_K: d, dmin, the 12 bytes of 6-bit scales and mins as the file packs them
    (the kernels unpack them, native/kscales.h), (Q5_K) the fifth bits, the nibbles;
    Q6_K: d, the int8 scales, then per sub-block its nibbles and high bits. The quants
    are regrouped so one byte column serves two (nibbles) or four (high bits) columns of
    the same sub-block, as native.h describes."""
    by = _by_group(raw, rows, supers, size)
    if qtype == QT.Q6_K:
        q = _q6_values(by)  # [g, u, 16, 256], 0..63
        parts = [_rows_of(by[..., 208:210]), _columns(by[..., 192:208])]
        subs = q.reshape(*q.shape[:3], 16, 16)  # [g, u, row, sub-block, column]
        low = subs & 15
        nibbles = low[..., :8] | (low[..., 8:] << 4)  # byte i: columns i, i + 8
        high = (subs >> 4).reshape(*subs.shape[:4], 4, 4)  # column 4 m + j at [m, j]
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        quads = np.bitwise_or.reduce(high << shifts, axis=-2)  # byte j: columns j + 4 m
        per_sub = np.concatenate([nibbles, quads], axis=-1)  # [g, u, row, 16, 12]
        parts.append(_columns(per_sub.reshape(*by.shape[:3], -1)))
        return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)
    parts = [_rows_of(by[..., 0:2]), _rows_of(by[..., 2:4]), _columns(by[..., 4:16])]
    nib = by[..., -128:].reshape(*by.shape[:3], 4, 1, 32)
    q = ((nib >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15).reshape(*by.shape[:3], 8, 32)
    if qtype == QT.Q5_K:
        qh = by[..., 16:48].reshape(*by.shape[:3], 1, 32)
        fifth = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [.., sub, col]
        bits = fifth.reshape(*fifth.shape[:4], 8, 4)  # column 4 m + b at [m, b]
        shifts = np.arange(8, dtype=np.uint8).reshape(8, 1)
        fifths = np.bitwise_or.reduce(bits << shifts, axis=-2)  # byte b: columns b + 4 m
        parts.append(_columns(fifths.reshape(*by.shape[:3], -1)))
    pairs = q[..., :16] | (q[..., 16:] << 4)  # byte i of a sub-block: columns i, 16 + i
    parts.append(_columns(pairs.reshape(*by.shape[:3], -1)))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


def _q6_values(by: np.ndarray) -> np.ndarray:
    """Q6_K's quants (0..63) [..., 256] from its blocks [..., 210]: weight 128 h + r has
    its low nibble in byte 64 h + r % 64 (high nibble for r >= 64), its top two bits at
    bits 2 (r / 32) of byte 128 + 32 h + r % 32."""
    lead = by.shape[:-1]
    ql = by[..., 0:128].reshape(*lead, 2, 1, 64)
    low = ((ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15).reshape(*lead, 2, 128)
    qh = by[..., 128:192].reshape(*lead, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(*lead, 2, 128)
    return (low | (high << 4)).reshape(*lead, 256)
