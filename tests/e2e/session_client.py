"""A small client of the sessions API for tests, and the snapshot-file corruptions they make."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from meshnet.protocol import meshnet_pb2 as pb

TURNS = ["hello there", "tell me more", "and then?", "thanks"]


class Api(Protocol):
    """A tracker's API and what its caller sends (a ``LocalMesh`` is one)."""

    @property
    def url(self) -> str: ...

    @property
    def api_headers(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class TrackerApi:
    """Another tracker of a mesh (sharing its database), called with the mesh's API key."""

    url: str
    api_headers: dict[str, str]


def turn_body(content: str, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {"content": content, "max_tokens": max_tokens, "temperature": 0.7, "seed": 11, **extra}


def new_session(api: Api, system: str | None = "be brief") -> str:
    r = httpx.post(
        f"{api.url}/v1/sessions", json={"system": system}, headers=api.api_headers, timeout=30
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def turn(api: Api, sid: str, content: str, key: str | None = None, **extra: Any) -> dict[str, Any]:
    headers = {**api.api_headers, **({"Idempotency-Key": key} if key else {})}
    r = httpx.post(
        f"{api.url}/v1/sessions/{sid}/turns",
        json=turn_body(content, **extra),
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def op(api: Api, sid: str, what: str) -> dict[str, Any]:
    r = httpx.post(f"{api.url}/v1/sessions/{sid}/{what}", headers=api.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def describe(api: Api, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{api.url}/v1/sessions/{sid}", headers=api.api_headers, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def reference_turns(api: Api, contents: list[str] = TURNS) -> list[list[int]]:
    """Every turn's ids in a session that stays hot throughout."""
    sid = new_session(api)
    out = []
    for content in contents:
        result = turn(api, sid, content)
        assert result["resume_path"] == "hot"
        out.append(result["ids"])
    return out


# --- snapshot files: length-prefixed KV frames ------------------------------------

_LENGTH = struct.Struct(">I")


def read_frames(path: Path) -> list[bytes]:
    data, frames, at = path.read_bytes(), [], 0
    while at < len(data):
        (n,) = _LENGTH.unpack_from(data, at)
        frames.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return frames


def write_frames(path: Path, frames: list[bytes]) -> None:
    path.write_bytes(b"".join(_LENGTH.pack(len(f)) + f for f in frames))


def rewrite_header(path: Path, **fields: Any) -> None:
    frames = read_frames(path)
    frame = pb.KVFrame.FromString(frames[0])
    for name, value in fields.items():
        setattr(frame.header, name, value)
    frames[0] = frame.SerializeToString()
    write_frames(path, frames)


def flip_bit(path: Path) -> None:
    frames = read_frames(path)
    chunk = bytearray(frames[1])
    chunk[len(chunk) // 2] ^= 0x10  # inside the chunk's KV bytes
    frames[1] = bytes(chunk)
    write_frames(path, frames)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def inflate_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    first = _LENGTH.unpack_from(data, 0)[0]
    _LENGTH.pack_into(data, 4 + first, 0x7FFFFFF0)  # the chunk frame's length field
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "bit-flip": (flip_bit, "chunk-hash"),
    "truncation": (truncate, "truncated"),
    "wrong-version": (lambda p: rewrite_header(p, version=99), "version"),
    "inflated-length": (inflate_length, "size-limit"),
    "wrong-model": (lambda p: rewrite_header(p, fingerprint="0" * 64), "wrong-model"),
}
