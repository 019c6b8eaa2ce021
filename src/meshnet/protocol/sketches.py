"""Top-k sketches: what a node on a backend that is not bit-exact commits to.

A node on ``numpy`` (its BLAS results vary with batching) cannot be checked by
hash: its rows differ from the verifier's in the last bits. TOPLOC's answer,
taken here: per position, commit the few channels of largest magnitude and
their values; the verifier recomputes the rows and accepts when the committed
channels really are among its largest and their values agree: each loosely,
three in four of the chunk's closely.

Layout of one position (``POSITION_BYTES`` = 8): ``SKETCH_K`` = 2 entries in
order of decreasing |value| (ties: lower channel first), each two little-endian
u16s:

- ``channel``: the channel index (so a row is at most ``MAX_WIDTH`` wide);
- ``mantissa``: the top 16 of the value's 23 float32 mantissa bits. Sign and
  exponent are not sent: the verifier takes them from its own value at that
  channel (trying the neighbouring powers of two, for a value that crossed one),
  so 16 bits carry 2^-17 relative precision where a float16 carries 2^-11, too
  coarse to tell a perturbed weight from rounding (docs/verification.md).

A chunk's sketch is its 32 positions' in order (commitments.SKETCH_BYTES): 256
bytes per 32 tokens (TOPLOC: ~258). Nodes and the verifier share this module.

The check (``sketch_mismatch``), as TOPLOC's, is statistical over the chunk: an
honest backend's error is mostly the encoding's (at most 2^-17), with a rare value
far off (a sum with cancellation); a cheat moves most values a little or some a
lot. The chunk's upper quartile of errors ignores the rare honest outliers.
"""

from __future__ import annotations

import numpy as np

from meshnet.errors import MalformedBundle, ModelError

SKETCH_K = 2  # channels committed per position
POSITION_BYTES = SKETCH_K * 4  # u16 channel + u16 mantissa, per channel
MAX_WIDTH = 65535  # widest row a u16 channel index can name
_MANTISSA_SHIFT = 7  # float32 mantissa bits dropped (23 kept as 16)
# Each committed value within VALUE_RTOL of the verifier's (relative), and its channel
# no more than VALUE_RTOL below the verifier's K-th largest |value|; the upper
# quartile of the chunk's relative errors within QUARTILE_RTOL (about twice the
# encoding's bound). The figures behind them: docs/verification.md.
VALUE_RTOL = 1e-3
QUARTILE_RTOL = 1.5e-5

_ENTRY = np.dtype([("channel", "<u2"), ("mantissa", "<u2")])


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
    bits = np.take_along_axis(x, top, axis=1).view(np.uint32)
    entries: np.ndarray = np.empty(top.shape, _ENTRY)
    entries["channel"] = top
    entries["mantissa"] = (bits & 0x7FFFFF) >> _MANTISSA_SHIFT
    return [entries[i].tobytes() for i in range(entries.shape[0])]


def _top_channels(x: np.ndarray) -> np.ndarray:
    """The ``SKETCH_K`` channels of largest |value| per row [T, K], largest first; ties
    by the lower channel (a stable sort), so node and verifier agree on equal rows."""
    order = np.argsort(-np.abs(x), axis=1, kind="stable")
    return order[:, :SKETCH_K]


def parse(sketch: bytes, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(channels [P, K] int64, mantissas [P, K] uint32) of a sketch of P positions;
    ``MalformedBundle`` when its length, a channel or a repeat is wrong."""
    if len(sketch) % POSITION_BYTES or not sketch:
        raise MalformedBundle(f"a sketch of {len(sketch)} bytes")
    entries = np.frombuffer(sketch, _ENTRY).reshape(-1, SKETCH_K)
    channels = entries["channel"].astype(np.int64)
    if (channels >= width).any():
        raise MalformedBundle(f"a sketch names a channel beyond the row's {width}")
    ordered = np.sort(channels, axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise MalformedBundle("a sketch names a channel twice at one position")
    return channels, entries["mantissa"].astype(np.uint32)


def committed_values(mine: np.ndarray, mantissas: np.ndarray) -> np.ndarray:
    """The values a sketch committed [P, K] (float64), rebuilt with the sign and
    exponent of ``mine`` (the verifier's values at those channels [P, K]), or of a
    neighbouring power of two, whichever lands nearest; the dropped mantissa bits are
    taken as the middle of their range."""
    mine = np.asarray(mine, np.float32)
    bits = mine.view(np.uint32) & np.uint32(0xFF800000)  # the verifier's sign and exponent
    bits |= mantissas << _MANTISSA_SHIFT | np.uint32(1 << (_MANTISSA_SHIFT - 1))
    base = bits.view(np.float32).astype(np.float64)
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
    channels, mantissas = parse(sketch, x.shape[1])
    if channels.shape[0] != x.shape[0]:
        raise MalformedBundle(f"a sketch of {channels.shape[0]} positions for {x.shape[0]} rows")
    with np.errstate(all="ignore"):
        mine = np.take_along_axis(x, channels, axis=1)
        wide = np.abs(mine.astype(np.float64))
        off = np.abs(committed_values(mine, mantissas) - mine) / wide
        magnitude = np.abs(x).astype(np.float64)
        kth = -np.partition(-magnitude, SKETCH_K - 1, axis=1)[:, SKETCH_K - 1 : SKETCH_K]
        below = (kth - wide) / kth  # > 0: not among the verifier's top K
        worse = np.maximum(off, below)
        return np.where(np.isnan(off) | np.isnan(below), np.nan, worse)


def sketch_mismatch(sketch: bytes, rows: np.ndarray) -> str:
    """Why ``sketch`` is not a sketch of ``rows`` [P, d] (see ``sketch_errors``): a value
    beyond ``VALUE_RTOL``, or an upper quartile beyond ``QUARTILE_RTOL``; "" when it is."""
    try:
        errors = sketch_errors(sketch, rows)
    except MalformedBundle as e:
        return e.message
    bad = ~(errors <= VALUE_RTOL)  # NaN fails too
    if bad.any():
        p, k = (int(i) for i in np.argwhere(bad)[0])
        return f"position {p}, committed channel {k}: off by {errors[p, k]:.3g} (> {VALUE_RTOL:g})"
    quartile = upper_quartile(errors)
    if quartile > QUARTILE_RTOL:
        return f"a quarter of the values off by {quartile:.3g} or more (> {QUARTILE_RTOL:g})"
    return ""


def upper_quartile(errors: np.ndarray) -> float:
    """The 75th percentile of a chunk's errors (``sketch_errors``)."""
    return float(np.quantile(errors, 0.75))
