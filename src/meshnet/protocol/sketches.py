"""Top-k sketches: what a node on a backend that is not bit-exact commits to.

A node on ``numpy`` (its BLAS results vary with batching) cannot be checked by
hash: its rows differ from the verifier's in the last bits. TOPLOC's answer,
taken here: per position, commit the few channels of largest magnitude and
their values; the verifier recomputes the row and accepts when the committed
channels really are among its largest and their values agree within a
tolerance.

Layout of one position (``POSITION_BYTES`` = 8): ``SKETCH_K`` = 2 entries in
order of decreasing |value| (ties: lower channel first), each two little-endian
u16s:

- ``channel``: the channel index (so a row is at most ``MAX_WIDTH`` wide);
- ``value``: bit 15 the value's sign, bits 0-14 the top 15 bits of its float32
  mantissa. The exponent is not sent: the verifier takes it from its own
  recomputed value (and its two neighbours, for a value that crossed a power of
  two), so 16 bits give 2^-16 relative precision where a float16 gives 2^-11
  (too coarse to tell a perturbed weight from rounding: docs/verification.md).

A chunk's sketch is its 32 positions' in order (commitments.SKETCH_BYTES): 256
bytes per 32 tokens (TOPLOC: ~258). Nodes and the verifier share this module.
"""

from __future__ import annotations

import numpy as np

from meshnet.errors import MalformedBundle, ModelError

SKETCH_K = 2  # channels committed per position
POSITION_BYTES = SKETCH_K * 4  # u16 channel + u16 sign/mantissa, per channel
MAX_WIDTH = 65535  # widest row a u16 channel index can name
_MANTISSA_SHIFT = 8  # float32 mantissa bits dropped (23 kept as 15)
# A committed value passes within RTOL of the verifier's value at its channel, and
# its channel when no more than RTOL below the verifier's K-th largest |value|.
# Honest numpy-vs-fast rows: <= 3.7e-6 apart, <= 1.6e-5 after the 2^-16 encoding;
# perturbed weights, a skipped layer, another quantization: >= 1.4e-4 in every chunk (measured:
# docs/verification.md).
RTOL = 5e-5

_ENTRY = np.dtype([("channel", "<u2"), ("value", "<u2")])


class SketchTooWide(ModelError):
    """Rows wider than a u16 channel index can name cannot be sketched: a model this
    wide cannot be served on a backend that commits sketches."""


def check_width(width: int) -> None:
    """Refuse rows of ``width`` channels (``SketchTooWide``) before any is sketched."""
    if width > MAX_WIDTH:
        raise SketchTooWide(f"rows of {width} channels cannot be sketched (max {MAX_WIDTH})")


def position_sketches(rows: np.ndarray) -> list[bytes]:
    """One ``POSITION_BYTES`` sketch per row of ``rows`` [T, d] (see the module's layout).

    Raises ``SketchTooWide`` when d > ``MAX_WIDTH``."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    check_width(x.shape[1])
    top = _top_channels(x)  # [T, K]
    values = np.take_along_axis(x, top, axis=1)
    bits = values.view(np.uint32)
    sign = (bits >> 31).astype(np.uint16) << 15
    mantissa = ((bits & 0x7FFFFF) >> _MANTISSA_SHIFT).astype(np.uint16)
    entries = np.empty(top.shape, _ENTRY)
    entries["channel"] = top
    entries["value"] = sign | mantissa
    return [entries[i].tobytes() for i in range(entries.shape[0])]


def _top_channels(x: np.ndarray) -> np.ndarray:
    """The ``SKETCH_K`` channels of largest |value| per row [T, K], largest first; ties
    by the lower channel (a stable sort), so node and verifier agree on equal rows."""
    order = np.argsort(-np.abs(x), axis=1, kind="stable")
    return order[:, :SKETCH_K]


def parse(sketch: bytes, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(channels [P, K] int64, signs [P, K] bool negative, mantissas [P, K]) of a sketch
    of P positions; ``MalformedBundle`` when its length, a channel or a repeat is wrong."""
    if len(sketch) % POSITION_BYTES or not sketch:
        raise MalformedBundle(f"a sketch of {len(sketch)} bytes")
    entries = np.frombuffer(sketch, _ENTRY).reshape(-1, SKETCH_K)
    channels = entries["channel"].astype(np.int64)
    if (channels >= width).any():
        raise MalformedBundle(f"a sketch names a channel beyond the row's {width}")
    if (np.sort(channels, axis=1)[:, 1:] == np.sort(channels, axis=1)[:, :-1]).any():
        raise MalformedBundle("a sketch names a channel twice at one position")
    value = entries["value"]
    return channels, (value >> 15).astype(bool), (value & 0x7FFF).astype(np.uint32)


def committed_values(
    rows: np.ndarray, channels: np.ndarray, negative: np.ndarray, mantissas: np.ndarray
) -> np.ndarray:
    """The values a sketch committed [P, K], rebuilt with the exponents of ``rows``
    [P, d] (the verifier's) at those channels, or of their neighbour powers of two,
    whichever lands nearest the verifier's value; the dropped mantissa bits are taken
    as the middle of their range."""
    mine = np.take_along_axis(np.asarray(rows, np.float32), channels, axis=1)
    bits = np.abs(mine).view(np.uint32) & np.uint32(0x7F800000)  # the verifier's exponent
    bits |= mantissas << _MANTISSA_SHIFT | np.uint32(1 << (_MANTISSA_SHIFT - 1))
    base = bits.view(np.float32).astype(np.float64)
    base = np.where(negative, -base, base)
    candidates = np.stack([base / 2, base, base * 2])  # [3, P, K]
    nearest = np.abs(candidates - mine).argmin(axis=0)
    return np.take_along_axis(candidates, nearest[None], axis=0)[0]


def sketch_errors(sketch: bytes, rows: np.ndarray) -> np.ndarray:
    """How far each committed value of ``sketch`` is from ``rows`` [P, d] (the verifier's,
    computed on another backend) [P, K], relative to the verifier's value at its channel,
    or how far that |value| falls below the row's K-th largest, relative to it (near-ties
    may swap places), whichever is worse; NaN where either is not a number.

    Raises ``MalformedBundle`` when the sketch cannot be read against these rows."""
    x = np.asarray(rows, np.float32)
    channels, negative, mantissas = parse(sketch, x.shape[1])
    if channels.shape[0] != x.shape[0]:
        raise MalformedBundle(f"a sketch of {channels.shape[0]} positions for {x.shape[0]} rows")
    with np.errstate(all="ignore"):
        mine = np.take_along_axis(x, channels, axis=1).astype(np.float64)
        off = np.abs(committed_values(x, channels, negative, mantissas) - mine) / np.abs(mine)
        magnitude = np.abs(x).astype(np.float64)
        kth = -np.partition(-magnitude, SKETCH_K - 1, axis=1)[:, SKETCH_K - 1 : SKETCH_K]
        below = (kth - np.abs(mine)) / kth  # > 0: not among the verifier's top K
        worse = np.maximum(off, below)
        return np.where(np.isnan(off) | np.isnan(below), np.nan, worse)


def sketch_mismatch(sketch: bytes, rows: np.ndarray) -> str:
    """Why ``sketch`` is not a sketch of ``rows`` [P, d] within ``RTOL`` (see
    ``sketch_errors``); "" when it is."""
    try:
        errors = sketch_errors(sketch, rows)
    except MalformedBundle as e:
        return e.message
    bad = ~(errors <= RTOL)  # NaN fails too
    if not bad.any():
        return ""
    p, k = (int(i) for i in np.argwhere(bad)[0])
    return f"position {p}, committed channel {k}: off by {errors[p, k]:.3g} (tolerance {RTOL:g})"
