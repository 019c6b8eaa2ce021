"""What the ledger says a turn cost, for tests that show a turn ran once however it was
delivered (after a kill, a stalled node, a database or a disk that went away)."""

from __future__ import annotations

import itertools
from typing import Any

import httpx

from meshnet.local_mesh import LocalMesh


def ledger(mesh: LocalMesh, generation_id: str) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{mesh.url}/admin/ledger",
        params={"generation_id": generation_id},
        headers=mesh.admin_headers,
        timeout=30,
    )
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


def assert_billed_once_like(mesh: LocalMesh, turn_id: str, reference_id: str) -> None:
    """``turn_id`` billed each layer's token positions exactly once, the same positions
    as an uninterrupted ``reference_id`` turn; none of its attempts was fenced by another
    running at the same time (``stale-epoch``)."""
    records = ledger(mesh, turn_id)
    assert not [r for r in records if r["kind"] == "stale-epoch"], records
    got = billed(records)
    for span, ranges in got.items():
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, f"layers {span}: positions billed twice: {ranges}"
    assert _covered(got) == _covered(billed(ledger(mesh, reference_id))), records


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
