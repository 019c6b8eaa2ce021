"""Verified work on real processes: dishonest nodes (tests/e2e/dishonest_node.py) that
claim the honest fingerprint are caught — by calibration before they are routed, or by
the verifier at rate 1.0 once they cheat — quarantined, their work never billable, and
every client's output equal to an honest mesh's."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NO_ROOM, MeshFactory, SoloIds
from faults import nodes
from gguf import GGMLQuantizationType as QT
from solo import solo_completion_ids
from verification_views import ledger, wait_state

from meshnet.engine.local import load_local_model
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh

PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # > 32 positions by itself
BODY = {"model": "long", "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
SEEDED = {**BODY, "temperature": 0.9, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 3}
LAUNCHER = str(Path(__file__).parent / "dishonest_node.py")


@pytest.fixture(scope="module")
def honest_ids(long_tiny: Path, solo_ids: SoloIds) -> list[int]:
    """What an honest computation answers: the request run in-process on the default
    backend (q8), which the nodes here run unless told otherwise."""
    return solo_ids(long_tiny, BODY)


def _complete(mesh: LocalMesh, body: dict[str, Any] = BODY) -> dict[str, Any]:
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _mesh_with_cheater(mesh_factory: MeshFactory, model: Path, cheat: str, after: int) -> LocalMesh:
    """A tracker at rate 1.0, an honest node of layers 2:4 and the cheater on 0:2; once
    the cheater's state is settled, an empty node (placement, or a failover's heal, gives
    it 0:2 when the cheater is out). NO_ROOM: node-0 is never widened over 0:2, so the
    routes the tests expect are the spares'."""
    args = ["--verify-rate", "1.0"]
    mesh = mesh_factory("2:4", model=model, tracker_args=args, need_route=False, node_args=NO_ROOM)
    prefix = [sys.executable, LAUNCHER, cheat, str(after), "--"]
    mesh.start_node("cheater", LayerRange(0, 2), prefix=prefix)
    return mesh


@pytest.fixture(scope="module")
def lookalikes(tiny_factory: Any) -> dict[str, Path]:
    """Files a cheater may compute with instead of the honest one: the same random
    weights quantized otherwise, and another model of the same shape."""
    requant = tiny_factory("long-q4.gguf", context_length=1024, matrix_type=QT.Q4_0)
    other = tiny_factory("long-other.gguf", context_length=1024, seed=11)
    return {"requantized": Path(requant), "other-model": Path(other)}


CHEATS = ("weights", "skip-layer", "ulp", "cached", "requantized", "other-model")


def test_calibration_keeps_every_kind_of_cheater_out(
    mesh_factory: MeshFactory,
    long_tiny: Path,
    honest_ids: list[int],
    lookalikes: dict[str, Path],
) -> None:
    """One cheater of each kind registers for layers 0:2 beside an honest 2:4: every
    one is quarantined by calibration, none is ever routed, and an empty node that
    placement gives 0:2 serves the honest answer (NO_ROOM: not node-0 widened over it)."""
    args = ["--verify-rate", "1.0"]
    mesh = mesh_factory(
        "2:4", model=long_tiny, tracker_args=args, need_route=False, node_args=NO_ROOM
    )
    for cheat in CHEATS:
        how = f"file:{lookalikes[cheat]}" if cheat in lookalikes else cheat
        prefix = [sys.executable, LAUNCHER, how, "0", "--"]
        mesh.start_node(f"cheater-{cheat}", LayerRange(0, 2), prefix=prefix)
    for cheat in CHEATS:
        node = wait_state(mesh, f"cheater-{cheat}", "quarantined")
        assert "calibration" in node["down_reason"], node
    mesh.start_node("spare", None)
    mesh.wait_ready(expected_nodes=2, timeout_s=180)  # the empty node took 0:2, calibrated
    out = _complete(mesh)
    assert out["meshnet"]["ids"] == honest_ids
    assert [h["node_id"] for h in out["meshnet"]["route"]] == ["spare", "node-0"]
    time.sleep(1.0)  # heartbeats and registrations keep them out
    states = nodes(mesh)
    for cheat in CHEATS:
        assert ledger(mesh, f"cheater-{cheat}") == [], cheat  # never routed: no work
        assert states[f"cheater-{cheat}"]["state"] == "quarantined", cheat


def test_a_node_given_new_layers_by_an_admin_is_calibrated_before_it_is_routed(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int]
) -> None:
    """A node that skips a layer is honest on one layer (0:1, which alone is no route),
    so it calibrates up; an admin's T3 gives it 0:2: from the moment the configure is
    answered it is not routable, and it is quarantined, not routed on the new layers
    until a heartbeat noticed them. The tracker's placement is off (``--replicas 0``): it
    could give the node 0:2 itself before the admin does, and it would not calibrate up."""
    args = ["--verify-rate", "1.0", "--replicas", "0"]
    mesh = mesh_factory("0:2,2:4", model=long_tiny, tracker_args=args)
    prefix = [sys.executable, LAUNCHER, "skip-layer", "0", "--"]
    mesh.start_node("cheater", LayerRange(0, 1), prefix=prefix)
    wait_state(mesh, "cheater", "up")
    r = _configure(mesh, "cheater", {"t3": {"layer_start": 0, "layer_end": 2}})
    assert r.status_code == 200 and r.json()["applied"], r.text
    assert nodes(mesh)["cheater"]["state"] in ("calibrating", "quarantined")
    node = wait_state(mesh, "cheater", "quarantined")
    assert "calibration" in node["down_reason"]
    assert _complete(mesh)["meshnet"]["ids"] == honest_ids
    assert ledger(mesh, "cheater") == []


def _configure(mesh: LocalMesh, node_id: str, body: dict[str, object]) -> httpx.Response:
    """An admin's configure, sent again after its ``Retry-After`` while the node answers
    429 (the tracker's own placement may be configuring it: one at a time), as a client
    of the admin API does; at most a minute of that."""
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(
            f"{mesh.url}/admin/nodes/{node_id}/configure",
            json=body,
            headers=mesh.admin_headers,
            timeout=120,
        )
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(float(r.headers["Retry-After"]))


@pytest.mark.parametrize("cheat", ["ulp", "sometimes"])
def test_the_verifier_catches_a_node_that_cheats_after_calibrating(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int], cheat: str
) -> None:
    mesh = _mesh_with_cheater(mesh_factory, long_tiny, cheat, after=2)
    wait_state(mesh, "cheater", "up")  # honest on its two calibration inputs
    mesh.start_node("spare", None)
    mesh.wait_ready(expected_nodes=3, timeout_s=180)
    out = _complete(mesh)  # the cheater is caught mid-generation and failed over
    assert out["meshnet"]["ids"] == honest_ids
    node = wait_state(mesh, "cheater", "quarantined")
    assert "verification failed" in node["down_reason"]
    records = ledger(mesh, "cheater")
    assert records and not any(r["billable"] for r in records)
    assert all(r["status"] in ("failed", "rejected", "cancelled") for r in records), records
    again = _complete(mesh)
    assert again["meshnet"]["ids"] == honest_ids
    assert all(h["node_id"] != "cheater" for h in again["meshnet"]["route"])


def test_a_last_hop_that_picks_other_ids_is_caught(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int]
) -> None:
    """A last hop that computes its rows honestly (so its commitments pass) but picks
    other ids than the sampler's: calibration samples nothing, the verifier's check of
    its picks against its own logits catches it; its work is not billed and the next
    request is answered exactly, without it."""
    args = ["--verify-rate", "1.0"]
    mesh = mesh_factory("0:2", model=long_tiny, tracker_args=args, need_route=False)
    prefix = [sys.executable, LAUNCHER, "sample", "0", "--"]
    mesh.start_node("cheater", LayerRange(2, 4), prefix=prefix)
    wait_state(mesh, "cheater", "up")
    mesh.start_node("spare", None)
    mesh.wait_ready(expected_nodes=3, timeout_s=180)
    _complete(mesh)  # ids it picked before it was caught reached the client
    node = wait_state(mesh, "cheater", "quarantined")
    assert "sampled other ids" in node["down_reason"], node
    records = ledger(mesh, "cheater")
    assert records and not any(r["billable"] for r in records)
    again = _complete(mesh)
    assert again["meshnet"]["ids"] == honest_ids
    assert all(h["node_id"] != "cheater" for h in again["meshnet"]["route"])
    for node_id in ("node-0", "spare"):  # the honest hops, after it too, were not blamed
        assert nodes(mesh)[node_id]["state"] == "up"


def test_a_node_that_sends_other_rows_than_it_committed_cannot_frame_the_next(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int]
) -> None:
    """The cheater on 0:2 commits honest rows but sends node-0 (2:4) others: node-0's
    rows then differ from the verifier's though every commitment before it is honest.
    node-0's digests of what it received say the rows it was sent are not those
    committed: one of the two lies, and both are quarantined (before, node-0 alone was,
    and the cheater stayed up to frame the next node). New nodes serve exactly."""
    mesh = _mesh_with_cheater(mesh_factory, long_tiny, "decouple", after=2)
    wait_state(mesh, "cheater", "up")  # honest on its two calibration inputs
    mesh.wait_ready(expected_nodes=2, timeout_s=180)
    # Caught mid-generation with no other node for either range: a 502, or an answer.
    httpx.post(f"{mesh.url}/v1/completions", json=BODY, headers=mesh.api_headers, timeout=120)
    for node_id in ("cheater", "node-0"):
        node = wait_state(mesh, node_id, "quarantined")
        assert "one of them lies" in node["down_reason"], node
    assert not any(r["billable"] for r in ledger(mesh, "cheater"))
    mesh.start_node("spare-0", LayerRange(0, 2))
    mesh.start_node("spare-1", LayerRange(2, 4))
    mesh.wait_ready(expected_nodes=2, timeout_s=180)  # the two new ones, calibrated
    again = _complete(mesh)
    assert again["meshnet"]["ids"] == honest_ids
    assert [h["node_id"] for h in again["meshnet"]["route"]] == ["spare-0", "spare-1"]


def test_a_node_that_withholds_its_commitments_is_quarantined_and_not_paid(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int]
) -> None:
    """The node on 0:2 calibrates, then commits nothing: no check could reach what it
    computes, and its work would be paid whatever it was. At the generation's end the
    chunks it ran are found uncommitted: it is quarantined and its work rejected; the
    honest node after it, whose inputs it could not vouch for, is not blamed."""
    mesh = _mesh_with_cheater(mesh_factory, long_tiny, "silent", after=2)
    wait_state(mesh, "cheater", "up")  # committed on its two calibration inputs
    mesh.wait_ready(expected_nodes=2, timeout_s=180)
    assert _complete(mesh)["meshnet"]["ids"] == honest_ids  # it computed honestly
    node = wait_state(mesh, "cheater", "quarantined")
    assert "no commitment came of positions it computed" in node["down_reason"], node
    deadline = time.monotonic() + 60
    while {r["status"] for r in ledger(mesh, "cheater")} != {"rejected"}:
        assert time.monotonic() < deadline, ledger(mesh, "cheater")  # settled in seconds
        time.sleep(0.5)
    assert nodes(mesh)["node-0"]["state"] == "up"
    assert all(r["status"] != "rejected" for r in ledger(mesh, "node-0"))


def test_an_operator_readmits_a_mended_node_which_calibrates_again(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int]
) -> None:
    """A node that failed its calibration is quarantined; an admin's readmit has it
    calibrate again on new inputs, which it passes now: it is up and routed, its answers
    exact. A user's key cannot readmit; an up node or an unknown one is refused and
    nothing changes."""
    mesh = _mesh_with_cheater(mesh_factory, long_tiny, "first", after=1)
    node = wait_state(mesh, "cheater", "quarantined")
    assert "calibration" in node["down_reason"], node
    url = f"{mesh.url}/admin/nodes/cheater/readmit"
    assert httpx.post(url, headers=mesh.api_headers, timeout=30).status_code == 401
    assert nodes(mesh)["cheater"]["state"] == "quarantined"
    r = httpx.post(url, headers=mesh.admin_headers, timeout=30)
    assert r.status_code == 200 and r.json() == {"node_id": "cheater", "state": "calibrating"}
    wait_state(mesh, "cheater", "up")
    assert nodes(mesh)["cheater"]["calibrations"] == 2  # the failed one, and this one
    mesh.wait_ready(expected_nodes=2, timeout_s=180)
    out = _complete(mesh)
    assert out["meshnet"]["ids"] == honest_ids
    assert [h["node_id"] for h in out["meshnet"]["route"]] == ["cheater", "node-0"]
    again = httpx.post(url, headers=mesh.admin_headers, timeout=30)
    assert again.status_code == 400, again.text
    assert "only a quarantined node" in again.json()["error"]["message"]
    unknown = httpx.post(
        f"{mesh.url}/admin/nodes/nobody/readmit", headers=mesh.admin_headers, timeout=30
    )
    assert unknown.status_code == 404
    assert nodes(mesh)["cheater"]["state"] == "up"


def test_a_readmitted_node_that_still_cheats_is_quarantined_again(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    mesh = _mesh_with_cheater(mesh_factory, long_tiny, "weights", after=0)
    wait_state(mesh, "cheater", "quarantined")
    r = httpx.post(
        f"{mesh.url}/admin/nodes/cheater/readmit", headers=mesh.admin_headers, timeout=30
    )
    assert r.status_code == 200, r.text
    node = wait_state(mesh, "cheater", "quarantined")
    assert "calibration" in node["down_reason"] and node["calibrations"] == 2, node
    assert ledger(mesh, "cheater") == []  # never routed


@pytest.mark.parametrize(
    ("layout", "backend"),
    [("0:4", "fast"), ("0:1,1:3,3:4", "fast"), ("0:1,1:3,3:4", "q8"), ("0:1,1:3,3:4", "q8-kv16")],
    ids=["one-node", "ring", "ring-q8", "ring-kv16"],
)
def test_an_honest_mesh_at_rate_one_fails_no_check(
    mesh_factory: MeshFactory, long_tiny: Path, honest_ids: list[int], layout: str, backend: str
) -> None:
    """Commitments come on every path (a node running by itself, a ring's forwarding and
    last hops) and are kept in the ledger; no honest chunk fails its check. Nodes on the
    q8 backend (the default) are calibrated and checked on q8, those on fast on fast and
    those on q8-kv16 (a float16 cache) on q8-kv16: each on its own exact numerics."""
    mesh = mesh_factory(
        layout,
        model=long_tiny,
        tracker_args=["--verify-rate", "1.0"],
        node_args=["--backend", backend],
    )
    outputs = [_complete(mesh)["meshnet"]["ids"] for _ in range(3)]
    assert outputs == [outputs[0]] * 3
    seeded = _complete(mesh, SEEDED)["meshnet"]["ids"]  # the last hop's picks are checked too
    assert seeded == _complete(mesh, SEEDED)["meshnet"]["ids"]
    # The in-process answer on the nodes' backend (q8's 8-bit activations may part from
    # fast's float32 ids; each is exact against its own).
    assert outputs[0] == solo_completion_ids(load_local_model(long_tiny, backend=backend), BODY)
    time.sleep(2.0)  # the verifier's queue drains
    for node_id in [f"node-{i}" for i in range(layout.count(",") + 1)]:
        assert nodes(mesh)[node_id]["state"] == "up"
        records = ledger(mesh, node_id)
        assert records and all(r["status"] != "rejected" for r in records)
        for r in records:  # every whole chunk it computed is committed in its record
            whole = r["token_end"] // 32 - -(-r["token_start"] // 32)
            assert len(bytes.fromhex(r["commitments"])) >= 20 * max(whole, 0), r
        # A repeated prompt starts on its cached prefix (docs/prefix-cache.md): a record
        # may then hold no whole chunk, but the first request's computed every one.
        assert any(len(bytes.fromhex(r["commitments"])) >= 20 for r in records)


def test_a_second_models_nodes_are_calibrated_and_its_cheater_kept_out(
    mesh_factory: MeshFactory, long_tiny: Path, tiny_factory: Any
) -> None:
    """With several models served, verification is tracker-wide: a node of the second
    model calibrates on that model's engine before it is routed, and one whose weights
    differ is quarantined, though it claims that model's fingerprint."""
    other = Path(tiny_factory("other.gguf", context_length=1024, seed=7))
    # The tracker serves "long" first, then "other"; the mesh's nodes load "other".
    args = ["--verify-rate", "1.0", "--model", str(long_tiny)]
    mesh = mesh_factory("0:4", model=other, tracker_args=args, need_route=False)
    cheat = [sys.executable, LAUNCHER, "weights", "0", "--"]
    mesh.start_node("other-cheater", LayerRange(0, 4), prefix=cheat)
    node = wait_state(mesh, "other-cheater", "quarantined")
    assert "calibration" in node["down_reason"]
    wait_state(mesh, "node-0", "up")
    for _ in range(3):
        r = httpx.post(
            f"{mesh.url}/v1/completions",
            json={**BODY, "model": "other", "max_tokens": 8},
            headers=mesh.api_headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert [h["node_id"] for h in r.json()["meshnet"]["route"]] == ["node-0"]
    assert ledger(mesh, "other-cheater") == []
