"""Tensors to and from wire messages, with every size checked before use.

A received tensor is rejected with ``MalformedBundle`` when its dtype is not
allowed, its shape has the wrong rank or too many elements, or its byte
length disagrees with dtype and shape. Nothing is allocated for a tensor
before those checks pass; the decoded array is a read-only view of the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.errors import MalformedBundle
from meshnet.protocol import meshnet_pb2 as pb

_DTYPES: dict[str, np.dtype] = {"f32": np.dtype("<f4"), "i64": np.dtype("<i8")}
_NAMES = {np.dtype(np.float32): "f32", np.dtype(np.int64): "i64"}

# gRPC refuses messages over this many bytes in either direction.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# gRPC channel and server options every peer of the data plane uses.
MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class TensorLimits:
    """What a receiver accepts: dtype, rank, and width of the last axis."""

    dtype: str
    rank: int
    max_rows: int  # first axis: tokens in one step
    width: int | None = None  # exact size of the last axis when rank is 2


def encode(array: np.ndarray) -> pb.Tensor:
    """Serialise ``array`` (float32 or int64) as little-endian bytes."""
    name = _NAMES.get(array.dtype)
    if name is None:
        raise TypeError(f"cannot send a {array.dtype} tensor")
    data = np.ascontiguousarray(array, dtype=_DTYPES[name]).tobytes()
    return pb.Tensor(dtype=name, shape=list(array.shape), data=data)


def decode(t: pb.Tensor, limits: TensorLimits) -> np.ndarray:
    """The array in ``t``; ``MalformedBundle`` if it breaks ``limits`` in any way."""
    if t.dtype != limits.dtype:
        raise MalformedBundle(f"tensor dtype {t.dtype!r}, expected {limits.dtype!r}")
    shape = list(t.shape)
    _check_shape(shape, limits)
    dtype = _DTYPES[t.dtype]
    expected = math.prod(shape) * dtype.itemsize
    if len(t.data) != expected:
        raise MalformedBundle(f"tensor of shape {shape} needs {expected} bytes, got {len(t.data)}")
    return _finite(np.frombuffer(t.data, dtype=dtype).reshape(shape))


def checked(array: np.ndarray, limits: TensorLimits) -> np.ndarray:
    """``array``, read off another wire whose lengths were bounded, held to the same
    ``limits`` as a decoded tensor; ``MalformedBundle`` if it breaks them."""
    name = _NAMES.get(array.dtype)
    if name != limits.dtype:
        raise MalformedBundle(f"tensor dtype {name or array.dtype!s}, expected {limits.dtype!r}")
    _check_shape(array.shape, limits)
    return _finite(array)


def _finite(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise MalformedBundle("tensor holds NaN or infinite values")
    return array


def _check_shape(shape: Sequence[int], limits: TensorLimits) -> None:
    if len(shape) != limits.rank:
        raise MalformedBundle(f"tensor rank {len(shape)}, expected {limits.rank}")
    if not 1 <= shape[0] <= limits.max_rows:
        raise MalformedBundle(f"tensor has {shape[0]} rows, limit {limits.max_rows}")
    if limits.rank == 2 and shape[1] != limits.width:
        raise MalformedBundle(f"tensor width {shape[1]}, expected {limits.width}")
