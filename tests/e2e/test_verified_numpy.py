"""Verified work on a backend that is not bit-exact, on real processes: nodes on
``numpy`` commit top-k sketches (protocol/sketches.py) and are checked within the
tolerance, so an honest numpy mesh calibrates and passes every check at rate 1.0,
while numpy cheaters (tests/e2e/dishonest_node.py) are quarantined — by calibration,
or by the verifier once they cheat — and their work is never billable."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NO_ROOM, MeshFactory
from faults import nodes
from solo import solo_completion_ids
from verification_views import ledger, wait_state

from meshnet.engine.local import load_local_model
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.protocol.commitments import SKETCH_BYTES
from meshnet.tracker.links import commitments

PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # > 32 positions by itself
BODY = {"model": "long", "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
LAUNCHER = str(Path(__file__).parent / "dishonest_node.py")
NUMPY = ["--backend", "numpy"]
VERIFY = ["--verify-rate", "1.0"]


@pytest.fixture(scope="module")
def numpy_ids(long_tiny: Path) -> list[int]:
    """What the numpy backend answers, unverified: the request run in-process on two
    chained numpy shards, [0, 2) and [2, 4), as the meshes below split the layers."""
    return solo_completion_ids(load_local_model(long_tiny, split=2, backend="numpy"), BODY)


def _complete(mesh: LocalMesh) -> dict[str, Any]:
    r = httpx.post(f"{mesh.url}/v1/completions", json=BODY, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _span_checks(mesh: LocalMesh) -> list[tuple[str, bool, str]]:
    """The verifier's verdicts the tracker recorded: (node, passed, detail)."""
    with sqlite3.connect(f"file:{mesh.data_dir / 'tracker.db'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT node_id, passed, detail FROM span_checks").fetchall()
    return [(str(n), bool(p), str(d)) for n, p, d in rows]


def test_an_honest_numpy_mesh_at_rate_one_calibrates_and_fails_no_check(
    mesh_factory: MeshFactory, long_tiny: Path, numpy_ids: list[int]
) -> None:
    """A ring of three numpy nodes (forwarding hops and a last hop) calibrates ``up``,
    answers what it answers unverified, and every chunk it committed — sketches, in the
    ledger — passes its check within the tolerance."""
    mesh = mesh_factory("0:1,1:3,3:4", model=long_tiny, tracker_args=VERIFY, node_args=NUMPY)
    outputs = [_complete(mesh)["meshnet"]["ids"] for _ in range(2)]
    assert outputs == [numpy_ids, numpy_ids]
    committed: dict[str, int] = {}
    for node_id in ("node-0", "node-1", "node-2"):
        records = ledger(mesh, node_id)
        assert records and all(r["status"] != "rejected" for r in records)
        committed[node_id] = 0
        for r in records:
            kept = commitments.decode(bytes.fromhex(r["commitments"]))
            assert all(len(c) == SKETCH_BYTES for c in kept.values()), r
            whole = r["token_end"] // 32 - -(-r["token_start"] // 32)
            assert len(kept) >= whole, r  # every whole chunk it computed is committed
            committed[node_id] += len(kept)
        assert committed[node_id] >= 2, (node_id, committed)
    checks = _span_checks(mesh)
    deadline = time.monotonic() + 60  # rate 1.0: every committed chunk is checked
    while any(sum(c[0] == n for c in checks) < k for n, k in committed.items()):
        assert time.monotonic() < deadline, (committed, checks)
        time.sleep(0.5)
        checks = _span_checks(mesh)
    assert all(passed for _, passed, _ in checks), checks
    states = nodes(mesh)
    assert all(states[n]["state"] == "up" for n in committed), states


def test_calibration_keeps_numpy_cheaters_out(
    mesh_factory: MeshFactory, long_tiny: Path, numpy_ids: list[int]
) -> None:
    """A numpy node that skips a layer, and one whose weights differ, register for 0:2
    beside an honest numpy 2:4: both are quarantined by calibration, never routed, and
    an empty numpy node that placement gives 0:2 serves the honest answer (node-0
    offers no room to be widened over 0:2 itself)."""
    mesh = mesh_factory(
        "2:4", model=long_tiny, tracker_args=VERIFY, node_args=[*NUMPY, *NO_ROOM], need_route=False
    )
    cheats = ("skip-layer", "weights")
    for cheat in cheats:
        prefix = [sys.executable, LAUNCHER, cheat, "0", "--"]
        mesh.start_node(f"cheater-{cheat}", LayerRange(0, 2), prefix=prefix)
    for cheat in cheats:
        node = wait_state(mesh, f"cheater-{cheat}", "quarantined")
        assert "calibration" in node["down_reason"], node
    mesh.start_node("spare", None)
    mesh.wait_ready(expected_nodes=2, timeout_s=180)
    out = _complete(mesh)
    assert out["meshnet"]["ids"] == numpy_ids
    assert [h["node_id"] for h in out["meshnet"]["route"]] == ["spare", "node-0"]
    for cheat in cheats:
        assert ledger(mesh, f"cheater-{cheat}") == [], cheat  # never routed: no work


def test_the_verifier_catches_a_numpy_node_that_cheats_after_calibrating(
    mesh_factory: MeshFactory, long_tiny: Path, numpy_ids: list[int]
) -> None:
    """Honest on its two calibration inputs, then its weights differ: the first sketch
    checked fails, it is quarantined, its work is never billable, the output is exact."""
    mesh = mesh_factory(
        "2:4", model=long_tiny, tracker_args=VERIFY, node_args=NUMPY, need_route=False
    )
    prefix = [sys.executable, LAUNCHER, "weights", "2", "--"]
    mesh.start_node("cheater", LayerRange(0, 2), prefix=prefix)
    wait_state(mesh, "cheater", "up")
    mesh.start_node("spare", None)
    mesh.wait_ready(expected_nodes=3, timeout_s=180)
    out = _complete(mesh)  # the cheater is caught mid-generation and failed over
    assert out["meshnet"]["ids"] == numpy_ids
    node = wait_state(mesh, "cheater", "quarantined")
    assert "verification failed" in node["down_reason"], node
    records = ledger(mesh, "cheater")
    assert records and not any(r["billable"] for r in records)
    assert all(r["status"] in ("failed", "rejected", "cancelled") for r in records), records
    failed = [c for c in _span_checks(mesh) if not c[1]]
    assert failed and {c[0] for c in failed} == {"cheater"}, failed
    assert all(c[1] for c in _span_checks(mesh) if c[0] != "cheater")
    again = _complete(mesh)
    assert again["meshnet"]["ids"] == numpy_ids
    assert all(h["node_id"] != "cheater" for h in again["meshnet"]["route"])
