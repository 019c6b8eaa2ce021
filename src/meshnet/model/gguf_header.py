"""Parse a GGUF header (metadata and tensor descriptors) straight from the memory map.

``gguf.GGUFReader`` builds a numpy view for every part of every value: two per
string, so a 128k-token vocabulary with its 280k merges costs it about a
million small arrays and ~30 s. This parser walks the same layout with
``struct`` over the mapped bytes and reads numeric arrays with one
``numpy.frombuffer``: the same vocabulary takes a fraction of a second. A string
array becomes one ``StringTable`` (its strings' bytes end to end, ~13 bytes a
token where 262k ``str`` objects took ~60), so the tokenizer builds from compact
data and a process that keeps the metadata keeps little. Scalars and numeric
arrays are Python values (lists). The ``gguf`` package supplies the constants
and types.

Every length and count read from the file is checked against the bytes left
in it before anything is allocated, so a corrupt header is a ``ModelFileError``,
never a huge allocation or a bare ``struct.error``.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from meshnet.errors import ModelFileError
from meshnet.model.string_table import NotUtf8, StringTable

_MAGIC = b"GGUF"
_VERSIONS = frozenset({2, 3})  # version 1 used 32-bit counts and is long gone
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32

# Fixed-size scalar types: struct format and numpy dtype (little-endian).
_SCALARS: dict[VT, tuple[str, np.dtype[Any]]] = {
    VT.UINT8: ("<B", np.dtype("<u1")),
    VT.INT8: ("<b", np.dtype("<i1")),
    VT.UINT16: ("<H", np.dtype("<u2")),
    VT.INT16: ("<h", np.dtype("<i2")),
    VT.UINT32: ("<I", np.dtype("<u4")),
    VT.INT32: ("<i", np.dtype("<i4")),
    VT.FLOAT32: ("<f", np.dtype("<f4")),
    VT.BOOL: ("<?", np.dtype("<u1")),
    VT.UINT64: ("<Q", np.dtype("<u8")),
    VT.INT64: ("<q", np.dtype("<i8")),
    VT.FLOAT64: ("<d", np.dtype("<f8")),
}
# The file's bytes: slicing an mmap gives bytes, whose decode is the fastest per string.
Buffer = mmap.mmap | bytes
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# numpy item types of the tensor types gguf.GGUFReader views as numbers; the rest
# (quantized blocks, BF16) are viewed as raw bytes, as the reader does.
_ITEM_TYPES: dict[QT, np.dtype[Any]] = {
    QT.F32: np.dtype(np.float32),
    QT.F16: np.dtype(np.float16),
    QT.F64: np.dtype(np.float64),
    QT.I8: np.dtype(np.int8),
    QT.I16: np.dtype(np.int16),
    QT.I32: np.dtype(np.int32),
    QT.I64: np.dtype(np.int64),
}


class HeaderTruncated(ModelFileError):
    """The bytes end before the header does: of a file read in part (a header fetched by
    range requests), read more; of a whole file, it is truncated."""


@dataclass(frozen=True)
class HeaderLayout:
    """The header without tensor data: metadata, tensor descriptors (offsets from
    ``data_start``) and where the data section starts; what a remote header gives."""

    metadata: dict[str, Any]
    infos: list[TensorInfo]
    data_start: int


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header says: its metadata and its tensors (views into the map)."""

    metadata: dict[str, Any]
    tensors: dict[str, gguf.ReaderTensor]


class _Cursor:
    """Reads little-endian values from ``buf`` at ``pos``; never past the end."""

    def __init__(self, buf: Buffer, name: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.name = name

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise HeaderTruncated(
                f"{self.name}: {what} at byte {self.pos} needs {n} bytes, "
                f"the file has {self.size - self.pos} left: truncated or corrupt"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{self.name}: {what} is not UTF-8: {e}") from None


def parse_header(buf: Buffer, name: str) -> GGUFHeader:
    """Parse the GGUF in ``buf`` (the whole file, mapped); ``name`` is used in errors."""
    layout = parse_layout(buf, name)
    return GGUFHeader(layout.metadata, _tensors(buf, name, layout.infos, layout.data_start))


def parse_layout(buf: Buffer, name: str) -> HeaderLayout:
    """Parse the header at the start of ``buf``, which may end anywhere after it (a
    file's first bytes); ``HeaderTruncated`` when it ends inside the header."""
    c = _Cursor(buf, name)
    c.need(4, "magic")
    if bytes(buf[:4]) != _MAGIC:
        raise ModelFileError(f"{name}: not a readable GGUF file (bad magic)")
    c.pos = 4
    version = c.u32("version")
    if version not in _VERSIONS:
        raise ModelFileError(f"{name}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = c.u64("tensor count")
    n_kv = c.u64("metadata count")
    # Each entry takes at least 24 (tensor) or 13 (key/value) bytes: bound the counts.
    c.need(n_tensors * 24 + n_kv * 13, "tensor and metadata entries")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string("metadata key")
        if key in metadata:
            raise ModelFileError(f"{name}: metadata key {key!r} appears twice")
        metadata[key] = _value(c, _value_type(c, key), key)
    infos = [_tensor_info(c) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{name}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-c.pos // alignment) * alignment
    for info in infos:
        _byte_count(name, info)  # a type of no size, or rows of partial blocks: refused here
    return HeaderLayout(metadata, infos, data_start)


def _value_type(c: _Cursor, key: str) -> VT:
    raw = c.u32(f"type of {key!r}")
    try:
        return VT(raw)
    except ValueError:
        raise ModelFileError(f"{c.name}: metadata {key!r} has unknown type {raw}") from None


def _value(c: _Cursor, vtype: VT, key: str) -> Any:
    if vtype == VT.STRING:
        return c.string(f"value of {key!r}")
    if vtype == VT.ARRAY:
        return _array(c, key)
    fmt, dtype = _SCALARS[vtype]
    c.need(dtype.itemsize, f"value of {key!r}")
    (v,) = struct.unpack_from(fmt, c.buf, c.pos)
    c.pos += dtype.itemsize
    return v


def _array(c: _Cursor, key: str) -> list[Any] | StringTable:
    etype = _value_type(c, key)
    count = c.u64(f"length of {key!r}")
    if etype == VT.ARRAY:
        raise ModelFileError(f"{c.name}: metadata {key!r} is an array of arrays")
    if etype == VT.STRING:
        c.need(count * 8, f"strings of {key!r}")  # each at least its length field
        return _strings(c, count, key)
    _, dtype = _SCALARS[etype]
    c.need(count * dtype.itemsize, f"array {key!r}")
    values = np.frombuffer(c.buf, dtype, count, c.pos)
    c.pos += count * dtype.itemsize
    items: list[Any] = (values.astype(bool) if etype == VT.BOOL else values).tolist()
    return items


def _strings(c: _Cursor, count: int, key: str) -> StringTable:
    """``count`` length-prefixed strings as one table; the hot loop of a large vocabulary.

    Only the lengths are read one by one; the strings' bytes are gathered in one
    numpy pass and checked as UTF-8 at once, never made into ``count`` objects.
    """
    buf, pos, size, unpack = c.buf, c.pos, c.size, _U64.unpack_from
    lengths = array("Q")
    append = lengths.append
    try:
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8 + n
            if pos > size:
                break
            append(n)
    except struct.error:  # not even a length field left
        pass
    if len(lengths) != count:
        raise HeaderTruncated(
            f"{c.name}: string {len(lengths)} of {key!r} runs past the end: truncated"
        )
    first = c.pos
    c.pos = pos
    sizes = np.frombuffer(lengths, np.uint64).astype(np.int64)  # each within the file
    starts = first + 8 * np.arange(1, count + 1, dtype=np.int64)  # past each length field
    starts[1:] += np.cumsum(sizes[:-1])
    return _gather(buf, first, pos, starts, sizes, c.name, key)


def _gather(
    buf: Buffer, first: int, end: int, starts: np.ndarray, lengths: np.ndarray, name: str, key: str
) -> StringTable:
    """The strings at ``starts`` (lengths ``lengths``) of ``buf[first:end]``, their length
    fields left out: a mask that is 0 over each 8-byte field, by a running sum."""
    region = np.frombuffer(buf, np.uint8, end - first, first)
    edges = np.zeros(end - first + 1, np.int8)
    np.add.at(edges, starts - 8 - first, 1)
    np.add.at(edges, starts - first, -1)
    in_field = np.cumsum(edges[:-1], dtype=np.int8)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    try:
        return StringTable.from_parts(region[in_field == 0].tobytes(), offsets)
    except NotUtf8 as e:
        raise ModelFileError(f"{name}: string {e.index} of {key!r} is not UTF-8") from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    qtype: QT
    offset: int  # from the start of the data section


def _tensor_info(c: _Cursor) -> TensorInfo:
    name = c.string("tensor name")
    n_dims = c.u32(f"dimension count of {name!r}")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ModelFileError(f"{c.name}: tensor {name!r} has {n_dims} dimensions")
    dims = tuple(c.u64(f"dimensions of {name!r}") for _ in range(n_dims))
    raw_type = c.u32(f"type of {name!r}")
    try:
        qtype = QT(raw_type)
    except ValueError:
        raise ModelFileError(f"{c.name}: tensor {name!r} has unknown type {raw_type}") from None
    return TensorInfo(name, dims, qtype, c.u64(f"offset of {name!r}"))


def _tensors(
    buf: Buffer, name: str, infos: list[TensorInfo], data_start: int
) -> dict[str, gguf.ReaderTensor]:
    """Descriptors whose ``data`` views the map, after checking each lies inside the file."""
    size = len(buf)
    whole = np.frombuffer(buf, np.uint8)
    out: dict[str, gguf.ReaderTensor] = {}
    for info in infos:
        if info.name in out:
            raise ModelFileError(f"{name}: tensor {info.name!r} appears twice")
        n_bytes = _byte_count(name, info)
        start = data_start + info.offset
        if start + n_bytes > size:
            raise ModelFileError(
                f"{name}: tensor {info.name!r} runs past the end of the file "
                f"(needs bytes up to {start + n_bytes}, file has {size}): truncated?"
            )
        out[info.name] = gguf.ReaderTensor(
            name=info.name,
            tensor_type=info.qtype,
            shape=np.array(info.dims, dtype=np.uint64),
            n_elements=int(np.prod(info.dims, dtype=object)),
            n_bytes=n_bytes,
            data_offset=start,
            data=_view(whole[start : start + n_bytes], info),
            field=gguf.ReaderField(offset=start, name=info.name),
        )
    return out


def byte_count(info: TensorInfo) -> int:
    """The bytes of the tensor ``info`` describes (checked by ``parse_layout``)."""
    return _byte_count("", info)


def _byte_count(name: str, info: TensorInfo) -> int:
    sizes = gguf.GGML_QUANT_SIZES.get(info.qtype)
    if sizes is None:
        raise ModelFileError(f"{name}: tensor {info.name!r} has type {info.qtype.name} of no size")
    block, type_size = sizes
    n = int(np.prod(info.dims, dtype=object))
    if info.dims[0] % block:
        raise ModelFileError(
            f"{name}: tensor {info.name!r} rows of {info.dims[0]} are not whole "
            f"{info.qtype.name} blocks of {block}"
        )
    return n // block * type_size


def _view(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes shaped as ``gguf.GGUFReader`` shapes them (outermost first)."""
    np_dims = tuple(reversed(info.dims))
    item = _ITEM_TYPES.get(info.qtype)
    if item is not None:
        return raw.view(item).reshape(np_dims)
    return raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, info.qtype))
