"""Reading a tracker's SSE streams in tests, with a hook called after every token."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from session_client import Api

from meshnet.auth.mesh_keys import Metadata
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc


@dataclass
class Streamed:
    generation_id: str = ""
    route: list[dict[str, Any]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # one per token chunk, in order
    final: dict[str, Any] | None = None  # the final chunk's meshnet object
    error: dict[str, Any] | None = None  # an in-stream error event
    hung_up: bool = False  # the reader stopped early


OnToken = Callable[[int, Streamed], bool | None]  # return True to hang up


def stream_completion(
    api: Api,
    body: dict[str, Any],
    on_token: OnToken | None = None,
    client: httpx.Client | None = None,
) -> Streamed:
    """POST a streamed completion and read it to the end (or until ``on_token`` says stop).

    Pass a ``client`` when streaming many: a new one per call costs ~20 ms of TLS set-up.
    """
    if client is None:
        with httpx.Client(timeout=120) as own:
            return stream_completion(api, body, on_token, own)
    out = Streamed()
    url, streamed = f"{api.url}/v1/completions", {**body, "stream": True}
    with client.stream("POST", url, json=streamed, headers=api.api_headers) as r:
        if r.status_code != 200:
            r.read()
            out.error = r.json()["error"]
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                continue
            meta = event.get("meshnet", {})
            if "generation_id" in meta and not out.generation_id:
                out.generation_id = meta["generation_id"]
                out.route = meta["route"]
            choice = event["choices"][0] if event.get("choices") else None
            if choice is not None and choice["finish_reason"] is not None:
                out.final = meta
            elif "ids" in meta:
                out.ids.extend(meta["ids"])
                if on_token is not None and on_token(len(out.ids), out):
                    out.hung_up = True
                    return out
    return out


def at(token: int, action: Callable[[Streamed], object]) -> OnToken:
    """A hook that runs ``action`` once, right after the ``token``-th token arrives."""

    def hook(n: int, s: Streamed) -> None:
        if n == token:
            action(s)

    return hook


def serving(s: Streamed, layers: tuple[int, int]) -> str:
    """The node of the stream's route that serves ``layers``."""
    return next(str(h["node_id"]) for h in s.route if tuple(h["layers"]) == layers)


def node_info(address: str, signed: Metadata) -> pb.InfoResponse:
    """The node's Info, called with the tracker's ``signed`` metadata for it."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.NodeStub(channel).Info(pb.InfoRequest(), timeout=5, metadata=signed)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")
