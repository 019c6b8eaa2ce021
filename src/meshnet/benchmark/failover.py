"""Failover cost: from a node's death to the next token, against re-prefilling the session.

One loopback mesh (A serves the first half of the layers, B and B' the second)
runs a greedy session; after ``kill_after`` streamed tokens the in-route B is
killed (SIGKILL) and the client's clock measures the gap to the next token.
In the same run, the alternative — a fresh request holding the whole history
so far (prompt + generated tokens), i.e. re-prefilling the session — is timed
to its first token. The killed node is restarted between rounds.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.info import load_model_info


@dataclass(frozen=True)
class FailoverRound:
    positions: int  # KV positions the session held when B died
    gap_ms: float  # kill -> next token, at the client
    recovery_ms: float  # failure seen -> next token, as the tracker reports it
    token_ms: float  # median time between tokens before the kill
    reprefill_ms: float  # a fresh request with the same history: time to its first token
    identical: bool  # the ids equal the uninterrupted run's


@dataclass(frozen=True)
class _Streamed:
    ids: list[int]
    arrivals: list[float]  # time.monotonic() of each token
    meta: dict[str, object]
    killed: str  # the node killed mid-stream ("" when none was)
    killed_at: float


def measure_failover(
    model: str | None, prompt_tokens: int, kill_after: int, rounds: int
) -> list[FailoverRound]:
    info = load_model_info(model)
    n = info.spec.n_layers
    half = n // 2
    ids = info.tokenizer.encode("The history of computing is long and full of surprises. " * 64)
    prompt = ids[:prompt_tokens]
    body = {
        "model": info.name,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": kill_after + 8,
    }
    with tempfile.TemporaryDirectory(prefix="meshnet-failover-") as tmp:
        mesh = LocalMesh(Path(tmp), model=model, heartbeat_timeout_s=10.0)
        try:
            mesh.start([LayerRange(0, half), LayerRange(half, n), LayerRange(half, n)])
            with httpx.Client(timeout=600) as client:
                _warm(client, mesh, body, ["node-1", "node-2"])
                reference = _stream(client, mesh, body, None)
                out: list[FailoverRound] = []
                for _ in range(rounds):
                    r = _round(client, mesh, body, prompt, reference.ids, kill_after)
                    out.append(r)
                return out
        finally:
            mesh.stop()


def _round(
    client: httpx.Client,
    mesh: LocalMesh,
    body: dict[str, object],
    prompt: list[int],
    reference: list[int],
    kill_after: int,
) -> FailoverRound:
    s = _stream(client, mesh, body, kill_after)
    gap = (s.arrivals[kill_after] - s.killed_at) * 1000
    before = [
        b - a for a, b in zip(s.arrivals[1:kill_after], s.arrivals[2:kill_after], strict=False)
    ]
    recoveries = s.meta.get("recoveries") or []
    assert isinstance(recoveries, list)
    recovery_ms = float(recoveries[0]["ms"]) if recoveries else float("nan")
    n = load_model_info(mesh.model).spec.n_layers
    mesh.start_node(s.killed, LayerRange(n // 2, n))
    _wait_up(client, mesh, s.killed)
    _warm(client, mesh, body, [s.killed])
    history = {**body, "prompt": prompt + s.ids[:kill_after], "max_tokens": 1}
    t0 = time.monotonic()
    again = _stream(client, mesh, history, None)
    reprefill = (again.arrivals[0] - t0) * 1000
    return FailoverRound(
        positions=len(prompt) + kill_after - 1,
        gap_ms=gap,
        recovery_ms=recovery_ms,
        token_ms=statistics.median(before) * 1000 if before else float("nan"),
        reprefill_ms=reprefill,
        identical=s.ids == reference,
    )


def _stream(
    client: httpx.Client, mesh: LocalMesh, body: dict[str, object], kill_after: int | None
) -> _Streamed:
    ids: list[int] = []
    arrivals: list[float] = []
    meta: dict[str, object] = {}
    route: list[dict[str, object]] = []
    killed, killed_at = "", 0.0
    url, streamed = f"{mesh.url}/v1/completions", {**body, "stream": True}
    with client.stream("POST", url, json=streamed, headers=mesh.api_headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            m = event.get("meshnet", {})
            route = route or m.get("route", [])
            if event["choices"] and event["choices"][0]["finish_reason"] is not None:
                meta = m
            elif "ids" in m:
                ids.extend(m["ids"])
                arrivals.append(time.monotonic())
                if kill_after is not None and len(ids) == kill_after:
                    killed = str(route[-1]["node_id"])
                    killed_at = time.monotonic()
                    mesh.kill_node(killed)
    return _Streamed(ids, arrivals, meta, killed, killed_at)


def _warm(client: httpx.Client, mesh: LocalMesh, body: dict[str, object], nodes: list[str]) -> None:
    """Run a short prompt through each of ``nodes`` so no measured step pays first-use costs
    (the dense weight copies prefill builds once per process)."""
    routes, admin = f"{mesh.url}/admin/routes", mesh.admin_headers
    for node in nodes:
        pin = {"node_ids": ["node-0", node]}
        client.post(routes, json=pin, headers=admin).raise_for_status()
        warm = {**body, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2}
        completions = f"{mesh.url}/v1/completions"
        client.post(completions, json=warm, headers=mesh.api_headers).raise_for_status()
    client.delete(routes, headers=admin).raise_for_status()


def _wait_up(client: httpx.Client, mesh: LocalMesh, node_id: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = client.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers)
        nodes = r.json()["nodes"]
        if any(n["node_id"] == node_id and n["state"] == "up" for n in nodes):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{node_id} did not come back")
