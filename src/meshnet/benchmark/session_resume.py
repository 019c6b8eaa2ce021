"""Resuming an evicted session from its snapshot against re-prefilling its history.

A tracker and two node processes serve the bundled model. One session is
built up to about ``target_tokens`` positions by chat turns (each turn's
prompt and reply become its history). Each round then evicts it (its KV
written to the snapshot store, the nodes' copy freed) and takes two short
turns: the first resumes from the snapshot; before the second the session is
evicted again and its snapshot's rows deleted, so the tracker re-prefills the
whole history. Both figures are the tracker's own ``resume_ms``: from the
start of the turn's delivery until every hop holds the session's history,
ready for the new prompt. Parked and hot resumes are measured the same way.

For scale, a plain one-shot prefill of a prompt as long as the session
(``/v1/completions``, one token) is timed too: cheaper than the re-prefill,
which must recompute each generated token as the decode step it was so that
the KV, and so the next reply, is bit-identical.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.info import load_model_info
from meshnet.tracker.storage.database import open_database

_QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
_FILLER = (
    "Here is some background for the question I will ask later. The history of the river "
    "valley covers farming, trade routes, the founding of towns, floods and the bridges "
    "built after them, the markets that grew around the bridges, and the schools and "
    "libraries that the market towns paid for. "
)


@dataclass(frozen=True)
class ResumeCost:
    tokens: list[int]  # session positions at each snapshot resume
    snapshot_ms: list[float]
    reprefill_ms: list[float]
    parked_ms: list[float]
    hot_ms: list[float]
    plain_prefill_ms: list[float]  # a fresh prompt of the session's length, to its first token

    @property
    def ratio(self) -> float:
        """Snapshot resume time as a share of re-prefill time (medians)."""
        return statistics.median(self.snapshot_ms) / statistics.median(self.reprefill_ms)


def measure_resume(model: str | None, target_tokens: int, rounds: int) -> ResumeCost:
    info = load_model_info(model)
    n_layers = info.spec.n_layers
    half = n_layers // 2
    filler = info.tokenizer.encode(_FILLER)
    with tempfile.TemporaryDirectory(prefix="meshnet-resume-") as tmp:
        mesh = LocalMesh(Path(tmp), model=model, tracker_args=_QUIET)
        try:
            mesh.start([LayerRange(0, half), LayerRange(half, n_layers)])
            return _measure(mesh, target_tokens, rounds, filler, info.name)
        finally:
            mesh.stop()


def _measure(
    mesh: LocalMesh, target_tokens: int, rounds: int, filler: list[int], model: str
) -> ResumeCost:
    sid = _post(mesh, "/v1/sessions", {"system": "You answer in one short paragraph."})["id"]
    tokens = 0
    turn = 0
    while tokens < target_tokens:  # build the history: long prompts, real replies
        _turn(mesh, sid, f"{_FILLER} Part {turn}: summarise it.", 60)
        tokens = _get(mesh, sid)["tokens"]
        turn += 1
    cost = ResumeCost([], [], [], [], [], [])
    for r in range(rounds):
        _post(mesh, f"/v1/sessions/{sid}/park", None)
        parked = _turn(mesh, sid, f"Round {r}: one word.", 1)
        hot = _turn(mesh, sid, f"Round {r}: another word.", 1)
        _post(mesh, f"/v1/sessions/{sid}/evict", None)
        cost.tokens.append(_get(mesh, sid)["tokens"])
        snap = _turn(mesh, sid, f"Round {r}: a third word.", 1)
        _post(mesh, f"/v1/sessions/{sid}/evict", None)
        _lose_snapshot(mesh, sid)  # the history must be recomputed
        full = _turn(mesh, sid, f"Round {r}: a fourth word.", 1)
        paths = [t["resume_path"] for t in (parked, hot, snap, full)]
        if paths != ["parked", "hot", "snapshot", "reprefill"]:
            raise RuntimeError(f"round {r} took resume paths {paths}")
        cost.parked_ms.append(parked["resume_ms"])
        cost.hot_ms.append(hot["resume_ms"])
        cost.snapshot_ms.append(snap["resume_ms"])
        cost.reprefill_ms.append(full["resume_ms"])
        prompt = (filler * (cost.tokens[-1] // len(filler) + 1))[: cost.tokens[-1]]
        t0 = time.perf_counter()
        _post(mesh, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
        cost.plain_prefill_ms.append((time.perf_counter() - t0) * 1000)
    return cost


def _lose_snapshot(mesh: LocalMesh, sid: str) -> None:
    """Delete the session's snapshot streams from the tracker's (SQLite) database."""
    db = open_database(mesh.data_dir / "tracker.db")
    try:
        db.run("DELETE FROM snapshot_chunks WHERE session_id = ?", (sid,))
    finally:
        db.close()


def _turn(mesh: LocalMesh, sid: str, content: str, max_tokens: int) -> dict[str, Any]:
    body = {"content": content, "max_tokens": max_tokens, "temperature": 0.0}
    return _post(mesh, f"/v1/sessions/{sid}/turns", body)


def _post(mesh: LocalMesh, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
    r = httpx.post(f"{mesh.url}{path}", json=body, headers=mesh.api_headers, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text}")
    return dict(r.json())


def _get(mesh: LocalMesh, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{mesh.url}/v1/sessions/{sid}", headers=mesh.api_headers, timeout=30)
    return dict(r.json())
