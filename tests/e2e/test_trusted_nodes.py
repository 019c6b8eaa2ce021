"""Trusted nodes on real processes (``meshnet tracker --trusted-node``): one tracker at
rate 1.0 trusting ``t-node`` (layers 0:2) and ``t-whole`` (0:4) beside untrusted nodes.
A trusted node is up without a calibration, its work is billable at once and never
checked; an untrusted 0:2 node's chunks are checked on ``t-node``, a 2:4 node's on
``t-whole`` (a last range: its commitments, not its logits); a cheater on 0:2 is caught
by a check run on ``t-node``; and with ``t-node`` killed, checks of 0:2 fall back to the
tracker's own engine and still pass. A last hop that picks other ids than the sampler's
is caught on ``t-whole`` too (it answers the logits of each of the chunk's positions).
Every client output equals an honest mesh's, but for the picks the caught last hop made.

The tests share one mesh and run in order (the last kills the trusted node)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory, SoloIds
from faults import nodes
from verification_views import ledger, wait_state

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.tracker.accounting.work_checks import SpanCheck, checks
from meshnet.tracker.storage.database import open_database

PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # > 32 positions by itself
BODY = {"model": "long", "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
LAUNCHER = str(Path(__file__).parent / "dishonest_node.py")
TRUSTED = "t-node"
WHOLE = "t-whole"  # trusted too; serves every layer: checks what ends at the last one


@pytest.fixture(scope="module")
def honest_ids(long_tiny: Path, solo_ids: SoloIds) -> list[int]:
    """What an honest computation answers: the request run in-process."""
    return solo_ids(long_tiny, BODY)


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, long_tiny: Path) -> LocalMesh:
    """node-0 serves 2:4 and ``honest`` 0:2 (both untrusted); the trusted ``t-node`` 0:2
    and ``t-whole`` 0:4. An idle mesh routes the smallest ids: neither trusted node
    unless a request names it. The prefix caches are off: with them, a node that served
    the prompt before is routed over a newly started cheater, and a prompt served from
    the cache leaves records with no whole chunk for the checks to read."""
    args = ["--verify-rate", "1.0", "--trusted-node", TRUSTED, "--trusted-node", WHOLE]
    args += ["--no-prefix-routing"]
    no_cache = ["--prefix-cache-mb", "0"]
    mesh = mesh_factory(
        "2:4", model=long_tiny, tracker_args=args, node_args=no_cache, need_route=False
    )
    mesh.start_node(TRUSTED, LayerRange(0, 2))
    mesh.start_node(WHOLE, LayerRange(0, 4))
    mesh.start_node("honest", LayerRange(0, 2))
    mesh.wait_ready(expected_nodes=4, timeout_s=180)
    return mesh


def _complete(mesh: LocalMesh, route: list[str] | None = None) -> dict[str, Any]:
    body = BODY if route is None else {**BODY, "meshnet": {"route": route}}
    headers = mesh.api_headers if route is None else mesh.admin_headers
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _checks(mesh: LocalMesh, node_id: str) -> list[SpanCheck]:
    """The tracker's recorded checks of a node's work (its own database, read here)."""
    db = open_database(mesh.data_dir / "tracker.db")
    try:
        return [c for c, _ in checks(db, node_id)]
    finally:
        db.close()


def _settled(mesh: LocalMesh, generation_id: str, node_id: str) -> list[dict[str, Any]]:
    """The node's records of a generation once none is ``unverified`` (checks are made in
    the background, and settlement passes every few seconds)."""
    deadline = time.monotonic() + 60
    while True:
        records = ledger(mesh, generation_id=generation_id, node_id=node_id)
        if (records and all(r["status"] != "unverified" for r in records)) or (
            time.monotonic() > deadline
        ):
            return records
        time.sleep(0.5)


def test_a_trusted_node_is_not_calibrated_and_checks_the_others(
    mesh: LocalMesh, honest_ids: list[int]
) -> None:
    states = nodes(mesh)
    for node_id in (TRUSTED, WHOLE):
        trusted = states[node_id]
        assert (trusted["state"], trusted["trusted"], trusted["calibrations"]) == ("up", True, 0)
    for other in ("honest", "node-0"):  # the others calibrated before they were routed
        assert not states[other]["trusted"] and states[other]["calibrations"] >= 1, other

    checked = _complete(mesh, ["honest", "node-0"])  # the untrusted 0:2 node's work
    on_trusted = _complete(mesh, [TRUSTED, "node-0"])  # the trusted node's
    assert checked["meshnet"]["ids"] == on_trusted["meshnet"]["ids"] == honest_ids

    gen = checked["meshnet"]["generation_id"]
    records = _settled(mesh, gen, "honest")
    assert records and all(r["status"] == "verified" for r in records), records
    honest_checks = [c for c in _checks(mesh, "honest") if c.generation_id == gen]
    assert len(honest_checks) >= 3  # every whole chunk of ~110 positions, at rate 1.0
    assert all(c.passed and c.detail == f"exact on trusted {TRUSTED}" for c in honest_checks)
    last_checks = [c for c in _checks(mesh, "node-0") if c.generation_id == gen]
    assert last_checks and all(
        c.passed and c.detail == f"exact on trusted {WHOLE}" for c in last_checks
    )
    states = nodes(mesh)
    assert states[TRUSTED]["trusted_checks"] >= len(honest_checks)
    assert states[WHOLE]["trusted_checks"] >= len(last_checks)

    records = ledger(mesh, generation_id=on_trusted["meshnet"]["generation_id"], node_id=TRUSTED)
    assert records and all(r["status"] == "completed" and r["billable"] for r in records)
    assert _checks(mesh, TRUSTED) == _checks(mesh, WHOLE) == []  # checks are made against them
    assert all(n["state"] == "up" for n in nodes(mesh).values())


def test_a_cheater_is_caught_by_a_check_on_the_trusted_node(
    mesh: LocalMesh, honest_ids: list[int]
) -> None:
    """Honest on its calibration, then one ulp off on every forward: its first drawn
    chunk is re-run on the trusted node, which says it differs. (Its id sorts first, so
    an idle mesh routes through it; the failover goes on on an honest 0:2 node.)"""
    prefix = [sys.executable, LAUNCHER, "ulp", "2", "--"]
    mesh.start_node("a-cheater", LayerRange(0, 2), prefix=prefix)
    wait_state(mesh, "a-cheater", "up")
    out = _complete(mesh)
    assert out["meshnet"]["ids"] == honest_ids
    node = wait_state(mesh, "a-cheater", "quarantined")
    assert f"trusted {TRUSTED}" in node["down_reason"], node
    # Every check of its work failed: its own chunks, on the trusted node (the first, which
    # quarantined it), and as the hop before node-0, whose chunks differ on t-whole too and
    # are checked again on the tracker's engine, which blames the hop before it.
    cheats = _checks(mesh, "a-cheater")
    assert cheats and not any(c.passed for c in cheats)
    assert f"trusted {TRUSTED}" in cheats[0].detail
    records = ledger(mesh, node_id="a-cheater")
    assert records and not any(r["billable"] for r in records), records
    states = nodes(mesh)
    assert states[TRUSTED]["state"] == states["node-0"]["state"] == "up"  # not blamed
    assert not any(not c.passed for c in _checks(mesh, "node-0"))


def test_a_last_hop_that_picks_other_ids_is_caught_on_the_trusted_node(
    mesh: LocalMesh, honest_ids: list[int]
) -> None:
    """A 2:4 node that computes honestly but picks the id after the sampler's: its rows
    pass on t-whole, the ids it picked do not (t-whole answered the logits of each of
    the chunk's positions). Ids it picked before it was caught reached the client (see
    docs/verification.md); the next request is exact, without it."""
    prefix = [sys.executable, LAUNCHER, "sample", "0", "--"]
    mesh.start_node("a-picker", LayerRange(2, 4), prefix=prefix)
    wait_state(mesh, "a-picker", "up")
    _complete(mesh)  # an idle mesh routes honest > a-picker (the smallest ids)
    node = wait_state(mesh, "a-picker", "quarantined")
    assert "sampled other ids" in node["down_reason"], node
    assert node["down_reason"].endswith(f"(trusted {WHOLE})"), node
    records = ledger(mesh, node_id="a-picker")
    assert records and not any(r["billable"] for r in records), records
    again = _complete(mesh)
    assert again["meshnet"]["ids"] == honest_ids
    assert "a-picker" not in [h["node_id"] for h in again["meshnet"]["route"]]


def test_without_the_trusted_node_checks_fall_back_to_the_trackers_engine(
    mesh: LocalMesh, honest_ids: list[int]
) -> None:
    mesh.kill_node(TRUSTED, signal.SIGKILL)
    out = _complete(mesh, ["honest", "node-0"])  # at once: it may not be marked down yet
    assert out["meshnet"]["ids"] == honest_ids
    gen = out["meshnet"]["generation_id"]
    records = _settled(mesh, gen, "honest")
    assert records and all(r["status"] == "verified" for r in records), records
    fallback = [c for c in _checks(mesh, "honest") if c.generation_id == gen]
    assert len(fallback) >= 3 and all(c.passed and c.detail == "exact" for c in fallback)
    assert nodes(mesh)["honest"]["state"] == "up"
