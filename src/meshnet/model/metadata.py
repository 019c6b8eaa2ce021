"""Typed reads of a GGUF file's metadata values, with the file named in every error."""

from __future__ import annotations

import math

from meshnet.errors import ModelFileError
from meshnet.model.gguf_file import GGUFFile


def int_value(f: GGUFFile, key: str, default: int | None = None) -> int:
    """``key`` as an integer (``default`` where absent; required when None). A per-layer
    array must hold one value: meshnet runs uniform layers only."""
    raw = f.value(key) if default is None else f.value_or(key, default)
    if isinstance(raw, list):
        if not raw or len(set(raw)) != 1:
            raise ModelFileError(f"{f.path.name}: {key} differs between layers")
        raw = raw[0]
    try:
        return int(raw)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{f.path.name}: {key} is not an integer") from e


def optional_int(f: GGUFFile, key: str) -> int | None:
    return int(f.value(key)) if f.has(key) else None


def float_value(f: GGUFFile, key: str, default: float) -> float:
    """``key`` as a finite float, ``default`` where absent."""
    raw = f.value_or(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{f.path.name}: {key} is not a number") from e
    if not math.isfinite(value):
        raise ModelFileError(f"{f.path.name}: {key} is not finite")
    return value
