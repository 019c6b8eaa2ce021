"""The relay port's byte format: a hello, input frames one way, refusals the other.

A hop that relays to the next over a raw TCP connection (node/relay_socket.py)
pays one ``sendall`` a frame, where a gRPC ``RelayStream`` frame goes through
two thread hops and an answer on each side. Everything here is pure: it lays
out and reads bytes, checking every length against a limit before anything is
allocated, and raises ``MalformedBundle`` on what breaks the format.

- **Hello** (sender first): ``MNR1``, the token's length (u16), the token: the
  same leave a ``RelayStream`` call carries as metadata, checked the same way.
  Answered by one **verdict**: status (u8: 0 accepted, else refused), a reason's
  length (u16) and the reason.
- **Input** (sender, then any number): ``_INPUT`` — kind 1, dtype code, the
  session id's length, epoch, step, rows, width (0: one axis) — then the session
  id and the array's raw little-endian bytes (``rows * max(width, 1)`` items).
  Not answered when filed.
- **Refusal** (receiver, only when an input was not filed): ``_REFUSAL`` — kind 2,
  the session id's, the failure kind's and the message's lengths, epoch, step —
  then those three strings. Kind 3 is the same, said before the receiver closes
  the connection (a frame it could not read).

A connection whose hello says ``MNH1`` instead asks for **head parts**
(node/head_assist.py): the last hop of a ring has the first, which holds the same
tied embedding, multiply its final normed rows by the head's first ``stop`` rows.

- **Ask** (sender): ``_ASK`` — kind 4, the ask's number, rows, width, ``stop``, the
  model file's sha256 and the backend's name (both must be the receiver's) — then
  the rows' float32 bytes.
- **Part** (receiver, one per ask, in order): ``_PART`` — kind 5, the ask's number,
  status (0: done), rows, columns, a refusal's length — then the refusal, or the
  logits' float32 bytes (``rows * columns``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from meshnet.errors import MalformedBundle

HELLO_MAGIC = b"MNR1"
HEAD_MAGIC = b"MNH1"  # a connection for head parts
MAX_TOKEN_BYTES = 1024
MAX_SESSION_BYTES = 128  # as node.wire.MAX_SESSION_ID
MAX_ROWS = 1 << 20
MAX_WIDTH = 1 << 16
MAX_INPUT_BYTES = 64 << 20  # one input's array
MAX_MESSAGE_BYTES = 1000  # a refusal's message (longer ones are cut)
MAX_KIND_BYTES = 64
MAX_ASK_ROWS = 16  # the rows of one head ask
MAX_HEAD_ROWS = 1 << 21  # a head's rows (its vocabulary)

INPUT = 1
REFUSAL = 2
CLOSING = 3  # a refusal said just before the receiver closes the connection
ASK = 4
PART = 5

_DTYPES: dict[int, tuple[str, np.dtype[Any]]] = {
    1: ("i64", np.dtype("<i8")),
    2: ("f32", np.dtype("<f4")),
}
_CODES = {np.dtype("<i8"): 1, np.dtype("<f4"): 2}
_ITEMS = dict(_DTYPES.values())  # "i64" / "f32" -> item type

HELLO = struct.Struct("<4sH")  # magic, token length
VERDICT = struct.Struct("<BH")  # status, reason length
INPUT_HEADER = struct.Struct("<BBHQQII")  # kind, dtype, sid len, epoch, step, rows, width
REFUSAL_HEADER = struct.Struct("<BHHHQQ")  # kind, sid len, kind len, message len, epoch, step
ASK_HEADER = struct.Struct("<BQHII32s16s")  # kind, number, rows, width, stop, sha256, backend
PART_HEADER = struct.Struct("<BQBHIH")  # kind, number, status, rows, columns, refusal len


class InputHeader(NamedTuple):
    """A relayed input's header, its lengths checked (a tuple: made on every ring hop)."""

    session_bytes: int
    epoch: int
    step: int
    dtype: str  # "i64" or "f32", as ``pb.Tensor.dtype``
    shape: tuple[int, ...]
    data_bytes: int


@dataclass(frozen=True)
class Refusal:
    """The receiver's word that one input was not filed (or that it is closing)."""

    closing: bool
    session_id: str
    epoch: int
    step: int
    kind: str
    message: str


def hello(token: str, magic: bytes = HELLO_MAGIC) -> bytes:
    raw = token.encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise MalformedBundle("a relay token is at most 1024 bytes")
    return HELLO.pack(magic, len(raw)) + raw


def read_hello(head: bytes) -> tuple[bytes, int]:
    """A hello's magic (``HELLO_MAGIC`` or ``HEAD_MAGIC``) and the token's length it
    announces; ``MalformedBundle`` if it is no hello."""
    magic, n = HELLO.unpack(head)
    if magic not in (HELLO_MAGIC, HEAD_MAGIC) or not 0 < n <= MAX_TOKEN_BYTES:
        raise MalformedBundle("not a relay hello")
    return magic, int(n)


def verdict(reason: str | None) -> bytes:
    """The answer to a hello: accepted (``None``) or refused for ``reason``."""
    if reason is None:
        return VERDICT.pack(0, 0)
    raw = reason.encode()[:MAX_MESSAGE_BYTES]
    return VERDICT.pack(1, len(raw)) + raw


def input_frame(session_id: str, epoch: int, step: int, x: np.ndarray) -> list[bytes | memoryview]:
    """An input's frame as parts to send in order (the array's bytes are not copied)."""
    sid = session_id.encode()
    code = _CODES.get(x.dtype) or _CODES.get(x.dtype.newbyteorder("<"))
    if code is None or x.ndim not in (1, 2) or len(sid) > MAX_SESSION_BYTES:
        raise MalformedBundle(f"cannot relay a {x.dtype} array of shape {x.shape}")
    if x.dtype != _DTYPES[code][1] or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=_DTYPES[code][1])  # little-endian, as it is read
    width = x.shape[1] if x.ndim == 2 else 0
    head = INPUT_HEADER.pack(INPUT, code, len(sid), epoch, step, x.shape[0], width)
    return [head + sid, x.data.cast("B")]


def read_input_header(raw: bytes) -> InputHeader:
    """An input's header, every length checked before the rest is read."""
    kind, code, sid_len, epoch, step, rows, width = INPUT_HEADER.unpack(raw)
    if kind != INPUT:
        raise MalformedBundle(f"a relay frame of kind {kind}, expected an input")
    if code not in _DTYPES:
        raise MalformedBundle(f"a relayed input of dtype code {code}")
    if not 0 < sid_len <= MAX_SESSION_BYTES:
        raise MalformedBundle(f"a session id of {sid_len} bytes")
    if not 0 < rows <= MAX_ROWS or width > MAX_WIDTH:
        raise MalformedBundle(f"a relayed input of {rows} rows of width {width}")
    name, dtype = _DTYPES[code]
    shape = (rows, width) if width else (rows,)
    data = rows * max(width, 1) * dtype.itemsize
    if data > MAX_INPUT_BYTES:
        raise MalformedBundle(f"a relayed input of {data} bytes")
    return InputHeader(sid_len, epoch, step, name, shape, data)


def as_array(header: InputHeader, data: bytes | memoryview) -> np.ndarray:
    """The input's array, a read-only view of ``data`` (``header.data_bytes`` long)."""
    return np.frombuffer(data, _ITEMS[header.dtype]).reshape(header.shape)


def refusal(closing: bool, session_id: str, epoch: int, step: int, kind: str, msg: str) -> bytes:
    sid, k = session_id.encode()[:MAX_SESSION_BYTES], kind.encode()[:MAX_KIND_BYTES]
    m = msg.encode()[:MAX_MESSAGE_BYTES]
    head = REFUSAL_HEADER.pack(
        CLOSING if closing else REFUSAL, len(sid), len(k), len(m), epoch, step
    )
    return head + sid + k + m


def read_refusal_header(raw: bytes) -> tuple[bool, int, int, int, int, int]:
    """(closing, sid length, kind length, message length, epoch, step), checked."""
    kind, sid_len, kind_len, msg_len, epoch, step = REFUSAL_HEADER.unpack(raw)
    if kind not in (REFUSAL, CLOSING):
        raise MalformedBundle(f"a relay answer of kind {kind}")
    if sid_len > MAX_SESSION_BYTES or kind_len > MAX_KIND_BYTES or msg_len > MAX_MESSAGE_BYTES:
        raise MalformedBundle("a relay refusal longer than its limits")
    return kind == CLOSING, sid_len, kind_len, msg_len, epoch, step


def read_refusal(head: tuple[bool, int, int, int, int, int], rest: bytes) -> Refusal:
    closing, sid_len, kind_len, _, epoch, step = head
    sid, kind = rest[:sid_len], rest[sid_len : sid_len + kind_len]
    message = rest[sid_len + kind_len :]
    return Refusal(
        closing,
        sid.decode(errors="replace"),
        epoch,
        step,
        kind.decode(errors="replace"),
        message.decode(errors="replace"),
    )


class Ask(NamedTuple):
    """A head ask's header, checked."""

    number: int
    rows: int
    width: int
    stop: int
    fingerprint: str  # the model file's sha256, hex
    backend: str


def ask_frame(number: int, x: np.ndarray, stop: int, fingerprint: str, backend: str) -> bytes:
    """Ask for ``x`` [rows, width] times the head's rows ``[0, stop)``."""
    x = np.ascontiguousarray(x, dtype="<f4")
    if x.ndim != 2 or not 0 < x.shape[0] <= MAX_ASK_ROWS or not 0 < stop <= MAX_HEAD_ROWS:
        raise MalformedBundle(f"cannot ask for {stop} head rows of an array {x.shape}")
    digest, name = bytes.fromhex(fingerprint), backend.encode()
    if len(digest) != 32 or len(name) > 16:
        raise MalformedBundle("a head ask names a sha256 and a backend of at most 16 bytes")
    head = ASK_HEADER.pack(ASK, number, x.shape[0], x.shape[1], stop, digest, name)
    return head + x.tobytes()


def read_ask(raw: bytes) -> Ask:
    """An ask's header, every length checked before its rows are read."""
    kind, number, rows, width, stop, digest, name = ASK_HEADER.unpack(raw)
    if kind != ASK:
        raise MalformedBundle(f"a head frame of kind {kind}, expected an ask")
    if not 0 < rows <= MAX_ASK_ROWS or not 0 < width <= MAX_WIDTH:
        raise MalformedBundle(f"a head ask of {rows} rows of width {width}")
    if not 0 < stop <= MAX_HEAD_ROWS or rows * stop * 4 > MAX_INPUT_BYTES:
        raise MalformedBundle(f"a head ask for {stop} rows")
    backend = name.rstrip(b"\0").decode(errors="replace")
    return Ask(number, rows, width, stop, digest.hex(), backend)


def ask_bytes(ask: Ask) -> int:
    return ask.rows * ask.width * 4


def part_frame(
    number: int, logits: np.ndarray | None, refusal: str = ""
) -> list[bytes | memoryview]:
    """The answer to ask ``number``: its logits [rows, columns], or (None) a refusal."""
    if logits is None:
        why = refusal.encode()[:MAX_MESSAGE_BYTES]
        return [PART_HEADER.pack(PART, number, 1, 0, 0, len(why)) + why]
    logits = np.ascontiguousarray(logits, dtype="<f4")
    rows, columns = logits.shape
    return [PART_HEADER.pack(PART, number, 0, rows, columns, 0), logits.data.cast("B")]


def read_part(raw: bytes | bytearray, ask: Ask) -> tuple[bool, int]:
    """(refused, bytes that follow: the reason's or the logits') of ``ask``'s answer,
    checked against it; ``MalformedBundle`` for an answer of another shape or order."""
    kind, number, status, rows, columns, why = PART_HEADER.unpack(raw)
    if kind != PART or number != ask.number:
        raise MalformedBundle(f"a head answer of kind {kind} to ask {number}, not {ask.number}")
    if status != 0:
        if why > MAX_MESSAGE_BYTES:
            raise MalformedBundle("a head refusal longer than its limit")
        return True, why
    if (rows, columns) != (ask.rows, ask.stop):
        raise MalformedBundle(f"a head answer of {rows}x{columns}, asked {ask.rows}x{ask.stop}")
    return False, rows * columns * 4
