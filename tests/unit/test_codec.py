"""Wire tensors: round trips, and every malformed bundle refused before use."""

import numpy as np
import pytest

from meshnet.errors import MalformedBundle
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb

HIDDEN = codec.TensorLimits("f32", 2, max_rows=16, width=8)


def test_round_trip_is_exact() -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert np.array_equal(codec.decode(codec.encode(x), HIDDEN), x)
    ids = np.array([1, 2, 49151], dtype=np.int64)
    assert codec.decode(codec.encode(ids), codec.TensorLimits("i64", 1, 8)).tolist() == [
        1,
        2,
        49151,
    ]


def test_bytes_are_little_endian_float32() -> None:
    t = codec.encode(np.array([[1.0]], dtype=np.float32))
    assert t.data == b"\x00\x00\x80\x3f" and t.dtype == "f32" and list(t.shape) == [1, 1]


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (pb.Tensor(dtype="f64", shape=[1, 8], data=b"\0" * 64), "dtype"),
        (pb.Tensor(dtype="f32", shape=[8], data=b"\0" * 32), "rank"),
        (pb.Tensor(dtype="f32", shape=[1, 9], data=b"\0" * 36), "width"),
        (pb.Tensor(dtype="f32", shape=[17, 8], data=b"\0" * 17 * 32), "rows"),
        (pb.Tensor(dtype="f32", shape=[0, 8], data=b""), "rows"),
        (pb.Tensor(dtype="f32", shape=[2, 8], data=b"\0" * 63), "bytes"),
        (pb.Tensor(dtype="f32", shape=[2**40, 8], data=b"\0" * 64), "rows"),
        (
            pb.Tensor(dtype="f32", shape=[1, 8], data=np.full(8, np.nan, np.float32).tobytes()),
            "NaN",
        ),
    ],
)
def test_malformed_tensors_are_refused(tensor: pb.Tensor, reason: str) -> None:
    with pytest.raises(MalformedBundle, match=reason):
        codec.decode(tensor, HIDDEN)


def test_unsendable_dtype() -> None:
    with pytest.raises(TypeError):
        codec.encode(np.zeros(3, dtype=np.float64))


@pytest.mark.parametrize(
    ("array", "reason"),
    [
        (np.zeros((1, 8), np.float64), "dtype"),
        (np.zeros(8, np.float32), "rank"),
        (np.zeros((1, 9), np.float32), "width"),
        (np.zeros((17, 8), np.float32), "rows"),
        (np.zeros((0, 8), np.float32), "rows"),
        (np.full((1, 8), np.inf, np.float32), "infinite"),
    ],
)
def test_an_array_from_another_wire_is_held_to_the_same_limits(
    array: np.ndarray, reason: str
) -> None:
    """The relay port reads arrays itself; what it files meets a decoded tensor's checks."""
    with pytest.raises(MalformedBundle, match=reason):
        codec.checked(array, HIDDEN)
    fine = np.ones((2, 8), np.float32)
    assert codec.checked(fine, HIDDEN) is fine


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_value_not_finite_anywhere_refuses_the_input(bad: float, rows: int) -> None:
    """A single NaN or infinity is refused wherever it is, in a lone row (a ring hop's
    decode input) as in a prompt's; nothing finite is, however large."""
    x = np.full((rows, 8), np.finfo(np.float32).max, np.float32)
    x[:, 0] = np.finfo(np.float32).min
    assert codec.checked(x, HIDDEN) is x
    for column in (0, 5, 7):
        y = x.copy()
        y[rows - 1, column] = bad
        with pytest.raises(MalformedBundle, match="NaN or infinite"):
            codec.checked(y, HIDDEN)
        with pytest.raises(MalformedBundle, match="NaN or infinite"):
            codec.decode(codec.encode(y), HIDDEN)
