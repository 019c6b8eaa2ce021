"""Several models on one tracker, with real processes: the bundled SmolLM2 and tiny
random-weight models (their own byte-level tokenizer) served at once, each request
exact against its model run alone; a model replaced with a session open and a
generation running (the generation finishes exact, the session's next turn answers on
the new model, the old model's node comes back empty and is reused); a release
that frees its nodes; a restarted tracker serving what it served; ``/v1/models``
listing only models with a complete route. The tests run in order on one mesh."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from solo import solo_chat_ids
from streams import Streamed, at, stream_completion
from tinymodel import TinyConfig, write_tiny_gguf

from meshnet.cli.main import main
from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.bundled import bundled_model_path
from meshnet.model.sampling import SamplingParams

BUNDLED = bundled_model_path().name.removesuffix(".gguf")
# No policy moves and no placement (a killed node must stay a gap): every move is asked for.
QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600", "--replicas", "0"]
LONG_TOKENS = 400
SESSION: dict[str, str] = {}  # the session the replacement test opens, used after a restart


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-a, tiny-b and tiny-c: the same shape and tokenizer, different weights."""
    d = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("tiny-a", "tiny-b", "tiny-c"), start=1):
        write_tiny_gguf(d / f"{name}.gguf", TinyConfig(seed=seed, context_length=1024))
    return d


@pytest.fixture(scope="module")
def solo(models_dir: Path) -> dict[str, LocalModel]:
    loaded = {p.stem: load_local_model(p) for p in sorted(models_dir.glob("*.gguf"))}
    loaded[BUNDLED] = load_local_model(None)
    return loaded


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[LocalMesh]:
    """node-0: all of SmolLM2; tiny-0: all of tiny-a; spare-0 and spare-1: empty."""
    mesh = LocalMesh(
        data_dir=tmp_path_factory.mktemp("mesh"),
        tracker_args=[
            *("--model", str(bundled_model_path())),
            *("--model", str(models_dir / "tiny-a.gguf")),
            *QUIET,
        ],
        node_args=["--model-dir", str(models_dir)],
    )
    try:
        mesh.start_tracker()
        mesh.start_node("node-0", LayerRange(0, 30))
        mesh.start_node(
            "tiny-0", LayerRange(0, 4), extra=["--model", str(models_dir / "tiny-a.gguf")]
        )
        mesh.start_node("spare-0", None)
        mesh.start_node("spare-1", None)
        mesh.wait_ready(expected_nodes=4, timeout_s=180)
        _until(lambda: set(_listed(mesh)) == {BUNDLED, "tiny-a"}, "both models listed")
        yield mesh
    finally:
        mesh.stop()


def _listed(mesh: LocalMesh) -> list[str]:
    r = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers, timeout=10)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def _admin_models(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/models", headers=mesh.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return {m["name"]: m for m in r.json()["models"]}


def _layers(mesh: LocalMesh) -> dict[str, list[int] | None]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=10)
    return {n["node_id"]: n["layers"] for n in r.json()["nodes"] if n["state"] == "up"}


def _until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.2)


def _chat(model: str, text: str, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _post(mesh: LocalMesh, path: str, body: dict[str, Any], admin: bool = False) -> httpx.Response:
    headers = mesh.admin_headers if admin else mesh.api_headers
    return httpx.post(f"{mesh.url}{path}", json=body, headers=headers, timeout=300)


def _session_turn(mesh: LocalMesh, sid: str, content: str, **extra: Any) -> httpx.Response:
    body = {"content": content, "max_tokens": 6, "temperature": 0, **extra}
    return _post(mesh, f"/v1/sessions/{sid}/turns", body)


def _long_body(solo: LocalModel) -> dict[str, Any]:
    """A sampled completion that runs its whole length on tiny-a (no early eos)."""
    for seed in range(1, 40):
        params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.9, seed=seed)
        if len(generate(solo.chain, solo.tokenizer, [5, 17, 42, 99], params).ids) == LONG_TOKENS:
            return {
                "prompt": [5, 17, 42, 99],
                "max_tokens": LONG_TOKENS,
                "temperature": 0.9,
                "seed": seed,
            }
    raise AssertionError("no seed runs tiny-a to max_tokens")


def test_two_models_served_at_once_each_exact(mesh: LocalMesh, solo: dict[str, LocalModel]) -> None:
    assert sorted(_listed(mesh)) == sorted([BUNDLED, "tiny-a"])
    for model in (BUNDLED, "tiny-a"):
        body = _chat(model, "What is the capital of France?")
        r = _post(mesh, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["meshnet"]["ids"] == solo_chat_ids(solo[model], body)
    metrics = httpx.get(f"{mesh.url}/metrics", headers=mesh.admin_headers, timeout=10).text
    for model, layers in ((BUNDLED, 30), ("tiny-a", 4)):  # every model's coverage
        assert f'meshnet_layer_replicas{{layer="{layers - 1}",model="{model}"}} 1.0' in metrics
    held = _admin_models(mesh)
    assert {m["state"] for m in held.values()} == {"serving"}
    assert held["tiny-a"]["complete"] and held["tiny-a"]["nodes"][0]["node_id"] == "tiny-0"


def test_an_unknown_model_is_404(mesh: LocalMesh) -> None:
    r = _post(mesh, "/v1/chat/completions", _chat("no-such-model", "hi"))
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model-not-found"
    r = _post(mesh, "/v1/sessions", {"model": "no-such-model"})
    assert r.status_code == 404, r.text


def test_refused_serves_change_nothing(mesh: LocalMesh, models_dir: Path) -> None:
    before = (_layers(mesh), sorted(_admin_models(mesh)))
    path = str(models_dir / "tiny-c.gguf")
    bad = [
        ({"path": path, "placement": [{"node_id": "node-0", "layers": [0, 4]}]}, "not empty"),
        ({"path": path, "placement": [{"node_id": "spare-0", "layers": [0, 3]}]}, "end at layer 3"),
        ({"path": path, "placement": [{"node_id": "ghost", "layers": [0, 4]}]}, "ghost"),
        ({"path": path, "nodes": 3}, "empty nodes are needed"),
        ({"path": str(models_dir / "missing.gguf")}, ""),
        ({"path": str(models_dir / "tiny-a.gguf")}, "served already"),
        ({"path": path, "placement": [{"node_id": "spare-0", "layers": [2, 2]}]}, ""),
    ]
    for body, why in bad:
        r = _post(mesh, "/admin/models", body, admin=True)
        assert r.status_code == 400, (body, r.text)
        assert why in r.json()["error"]["message"]
    r = _post(mesh, "/admin/models", {"path": path}, admin=False)
    assert r.status_code in (401, 403)
    assert (_layers(mesh), sorted(_admin_models(mesh))) == before


def test_replace_with_a_session_open_and_a_generation_running(
    mesh: LocalMesh, solo: dict[str, LocalModel], models_dir: Path
) -> None:
    r = _post(mesh, "/v1/sessions", {"model": "tiny-a", "system": "be brief"})
    assert r.status_code == 200 and r.json()["model"] == "tiny-a", r.text
    sid = SESSION["id"] = r.json()["id"]
    first = _session_turn(mesh, sid, "hello there")
    assert first.status_code == 200, first.text
    wrong = _session_turn(mesh, sid, "more", model=BUNDLED)
    assert wrong.status_code == 400, wrong.text  # a turn on another model than its session's

    long_body = {"model": "tiny-a", **_long_body(solo["tiny-a"])}
    replaced: dict[str, Any] = {}

    def replace(_: Streamed) -> None:
        body = {
            "path": str(models_dir / "tiny-b.gguf"),
            "placement": [{"node_id": "spare-0", "layers": [0, 4]}],
            "drain_s": 120,
        }
        rr = _post(mesh, "/admin/models/tiny-a/replace", body, admin=True)
        assert rr.status_code == 202, rr.text
        replaced.update(rr.json())

    streamed = stream_completion(mesh, long_body, at(3, replace))
    assert replaced["replaced"]["state"] == "draining"
    # The switch came at token 3 of the generation; the count of those still running is
    # taken when the answer comes, after tiny-b loaded, which a loaded host's 400 tokens
    # can outrun: what must hold is that the generation ends exact on the old model.
    assert replaced["model"]["name"] == "tiny-b" and replaced["model"]["complete"]
    want = generate(
        solo["tiny-a"].chain,
        solo["tiny-a"].tokenizer,
        long_body["prompt"],
        SamplingParams(max_tokens=LONG_TOKENS, temperature=0.9, seed=long_body["seed"]),
    ).ids
    assert streamed.error is None and streamed.final is not None
    assert streamed.final["ids"] == want  # the old model's generation finished, exact

    # Drained: the old model is gone, its node empty; its name now leads to tiny-b.
    _until(lambda: "tiny-a" not in _admin_models(mesh), "tiny-a released")
    _until(lambda: _layers(mesh)["tiny-0"] is None, "tiny-0 empty")
    assert sorted(_listed(mesh)) == sorted([BUNDLED, "tiny-b"])
    body = _chat("tiny-a", "hi")
    r = _post(mesh, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["model"] == "tiny-b", r.text
    assert r.json()["meshnet"]["ids"] == solo_chat_ids(solo["tiny-b"], {**body, "model": "tiny-b"})

    # The session's next turn runs on tiny-b, re-prefilled from the conversation.
    second = _session_turn(mesh, sid, "tell me more")
    assert second.status_code == 200, second.text
    out = second.json()
    assert out["resume_path"] == "reprefill" and out["rebased_from"] == "tiny-a"
    conversation = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": first.json()["text"]},
            {"role": "user", "content": "tell me more"},
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    assert out["ids"] == solo_chat_ids(solo["tiny-b"], conversation)
    third = _session_turn(mesh, sid, "and then?")
    assert third.status_code == 200, third.text
    assert third.json()["resume_path"] == "hot"
    info = httpx.get(f"{mesh.url}/v1/sessions/{sid}", headers=mesh.api_headers, timeout=10)
    assert info.json()["model"] == "tiny-b"


def test_freed_nodes_are_reused_and_release_frees_them(
    mesh: LocalMesh,
    solo: dict[str, LocalModel],
    models_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Through the operator commands: tiny-0 was emptied by the replacement above.
    admin = ["models", "--url", mesh.url, "--admin-token", mesh.credentials.admin_token]
    where = "tiny-0=0:2,spare-1=2:4"
    assert main([*admin, "serve", str(models_dir / "tiny-c.gguf"), "--placement", where]) == 0
    assert "tiny-c: serving, route complete; tiny-0[0:2], spare-1[2:4]" in capsys.readouterr().out
    assert "tiny-c" in _listed(mesh)
    body = _chat("tiny-c", "hello")
    r = _post(mesh, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["meshnet"]["route"]) == 2
    assert r.json()["meshnet"]["ids"] == solo_chat_ids(solo["tiny-c"], body)

    assert main([*admin, "release", "tiny-c", "--drain", "5"]) == 0
    assert "tiny-c: draining" in capsys.readouterr().out
    assert "tiny-c" not in _listed(mesh)  # no new request from the release on
    assert _post(mesh, "/v1/chat/completions", body).status_code == 404
    _until(lambda: "tiny-c" not in _admin_models(mesh), "tiny-c released")
    _until(lambda: _layers(mesh)["tiny-0"] is None and _layers(mesh)["spare-1"] is None, "freed")
    gone = httpx.delete(f"{mesh.url}/admin/models/tiny-c", headers=mesh.admin_headers, timeout=30)
    assert gone.status_code == 404
    assert main([*admin, "release", "tiny-c"]) == 2  # the operator is told, nothing changes
    assert "no model 'tiny-c'" in capsys.readouterr().err


def test_a_restarted_tracker_serves_what_it_served(mesh: LocalMesh) -> None:
    # Its flags say SmolLM2 and tiny-a; since, tiny-a was replaced by tiny-b (recorded).
    assert mesh.tracker is not None
    mesh.tracker.terminate()
    mesh.tracker.wait(timeout=30)
    mesh.start_tracker()
    _until(lambda: _reachable(mesh), "the tracker answers again")
    _until(lambda: sorted(_listed(mesh)) == sorted([BUNDLED, "tiny-b"]), "both listed again")
    assert sorted(_admin_models(mesh)) == sorted([BUNDLED, "tiny-b"])
    r = _post(mesh, "/v1/chat/completions", _chat("tiny-a", "hi"))
    assert r.status_code == 200 and r.json()["model"] == "tiny-b", r.text
    sid = SESSION["id"]  # opened on tiny-a, rebased onto tiny-b before the restart
    r = _session_turn(mesh, sid, "thanks")
    assert r.status_code == 200, r.text
    assert r.json()["resume_path"] in ("hot", "parked") and "rebased_from" not in r.json()


def _reachable(mesh: LocalMesh) -> bool:
    try:
        return httpx.get(f"{mesh.url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_model_is_listed_only_while_its_route_is_complete(mesh: LocalMesh) -> None:
    assert sorted(_listed(mesh)) == sorted([BUNDLED, "tiny-b"])
    mesh.kill_node("spare-0")  # tiny-b's only node
    _until(lambda: _listed(mesh) == [BUNDLED], "tiny-b unlisted")
    held = _admin_models(mesh)
    assert held["tiny-b"]["state"] == "serving" and not held["tiny-b"]["complete"]
