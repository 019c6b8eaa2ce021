"""Plain-text tables for the operator commands: one header row, columns padded to fit."""

from __future__ import annotations

from collections.abc import Sequence

from meshnet.node.preflight.result import size as readable_size


def render(headers: Sequence[str], rows: Sequence[Sequence[object]], empty: str = "(none)") -> str:
    """``rows`` under ``headers``, each column as wide as its widest cell; columns of
    numbers (``None`` shown as ``-``) right-aligned, others left. ``empty`` when no rows."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    numeric = [_numeric([row[i] for row in rows]) for i in range(len(headers))]
    lines = [_line(headers, widths, numeric)] + [_line(row, widths, numeric) for row in cells]
    if not rows:
        lines.append(empty)
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int], right: Sequence[bool]) -> str:
    columns = zip(cells, widths, right, strict=True)
    return "  ".join(text.rjust(w) if r else text.ljust(w) for text, w, r in columns).rstrip()


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)


def _numeric(column: Sequence[object]) -> bool:
    """Numbers, some of them perhaps none (``-``), and at least one a number."""
    numbers = [v for v in column if v is not None]
    return bool(numbers) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in numbers
    )


def size(n: float | None) -> str | None:
    """Bytes, readable (``None`` stays none)."""
    return None if n is None else readable_size(n)


def age(seconds: float | None) -> str | None:
    """A duration, short: ``0.4s``, ``12s``, ``5m``, ``3h``, ``2d``."""
    if seconds is None:
        return None
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span:.0f}{unit}"
    return f"{seconds:.0f}s"
