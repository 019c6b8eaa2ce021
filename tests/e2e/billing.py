"""What the ledger says a turn cost, for tests that show a turn ran once however it was
delivered (after a kill, a stalled node, a database or a disk that went away)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx

from meshnet.local_mesh import LocalMesh


def ledger(mesh: LocalMesh, generation_id: str, within_s: float = 15.0) -> list[dict[str, Any]]:
    """The generation's records; a database still reconnecting is waited for."""
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.get(
            f"{mesh.url}/admin/ledger",
            params={"generation_id": generation_id},
            headers=mesh.admin_headers,
            timeout=30,
        )
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    return list(r.json()["records"])


def billed(records: list[dict[str, Any]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per layer span, the token ranges its completed (billable) attempts computed, in order."""
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r in records:
        if r["billable"]:
            spans.setdefault((r["layer_start"], r["layer_end"]), []).append(
                (r["token_start"], r["token_end"])
            )
    return {span: sorted(ranges) for span, ranges in spans.items()}


def assert_billed_once_like(
    mesh: LocalMesh, turn_id: str, reference_id: str, within_s: float = 15.0
) -> None:
    """``turn_id`` billed each layer's token positions exactly once, the same positions
    as an uninterrupted ``reference_id`` turn; none of its attempts was fenced by another
    running at the same time (``stale-epoch``). Records the database refused wait in the
    tracker's ledger spool and are written when it takes them again: read until the turn's
    are all there, at most ``within_s``."""
    want = _covered(billed(ledger(mesh, reference_id)))
    deadline = time.monotonic() + within_s
    while True:
        records = ledger(mesh, turn_id)
        got = billed(records)
        if _covered(got) == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not [r for r in records if r["kind"] == "stale-epoch"], records
    for span, ranges in got.items():
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, f"layers {span}: positions billed twice: {ranges}"
    assert _covered(got) == want, records


def _covered(
    spans: dict[tuple[int, int], list[tuple[int, int]]],
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per layer span, the positions billed, as merged ranges."""
    merged: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for span, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for start, end in ranges:
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
        merged[span] = out
    return merged
