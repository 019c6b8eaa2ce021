"""``meshnet up --model hf:ORG/REPO:QUANT`` against a local hub (``tests/hub_server.py``):
the real processes resolve the reference with the real ``huggingface_hub`` client, each
node fetches only its layers' tensors, and the mesh answers as the file does in one
process. Nothing reaches the internet: ``HF_ENDPOINT`` is the local hub."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_models import N_LAYERS, Q4_PARTS, Q8, REPO, q4_size, unsplit_q4, write_hub
from hub_server import HubServer

from meshnet.auth.credentials import CREDENTIALS_FILE, read_user_credentials
from meshnet.cli.main import main
from meshnet.engine.generate import generate
from meshnet.engine.local import load_local_model
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, free_port
from meshnet.model.gguf_file import open_gguf
from meshnet.model.sampling import SamplingParams
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.manifest import TensorHash
from meshnet.model_source.reference import parse_ref
from meshnet.model_source.remote import locate
from meshnet.model_source.shard_store import fetch_shard
from meshnet.model_source.tracker_source import tracker_model

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(write_hub(tmp_path_factory.mktemp("hub"))) as server:
        yield server


def _hub_env(hub: HubServer, tmp: Path) -> dict[str, str]:
    """The local hub as the hub, and caches of the test's own."""
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(tmp / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "MESHNET_CACHE": str(tmp / "cache"),
    }


def _env(hub: HubServer, tmp: Path) -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", **_hub_env(hub, tmp)}


def _meshnet(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshnet.cli.main", *args]


def _solo_text(path: Path, max_tokens: int) -> str:
    model = load_local_model(path)
    ids = model.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return generate(model.chain, model.tokenizer, ids, params).text


def test_up_serves_a_hub_reference_each_node_fetching_only_its_layers(
    hub: HubServer, tmp_path: Path
) -> None:
    port = free_port()
    half = N_LAYERS // 2
    before = dict(hub.sent)
    up = subprocess.Popen(
        _meshnet(
            "up",
            "--model",
            f"hf:{REPO}:Q4_K_M",
            "--layout",
            f"0:{half},{half}:{N_LAYERS}",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "mesh"),
            "--threads",
            "1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(hub, tmp_path),
    )
    try:
        assert up.stdout is not None
        line, deadline = "", time.monotonic() + 180
        while "meshnet API at" not in line and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, "meshnet up exited early"
        key = read_user_credentials(tmp_path / "mesh" / CREDENTIALS_FILE).api_key
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            json={"model": "tiny-Q4_K_M", "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _solo_text(unsplit_q4(hub.root), 12)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
        if up.stdout is not None:
            up.stdout.close()
    size = q4_size(hub.root)  # published split: three parts
    # `up` read the headers to plan (the tracker found them in the cache): no tensor.
    sent = {k: v - before.get(k, 0) for k, v in hub.sent.items()}
    assert 0 < sent["up"] < 0.1 * size and sent.get("tracker", 0) == 0
    for node in ("node-0", "node-1"):
        assert 0 < sent[node] < 0.6 * size, (node, sent[node], size)


def test_a_missing_quantization_is_a_typed_error_naming_the_files(
    hub: HubServer, tmp_path: Path
) -> None:
    done = subprocess.run(
        _meshnet("generate", "--model", f"hf:{REPO}:Q5_K_S", "--prompt", "hi"),
        capture_output=True,
        text=True,
        env=_env(hub, tmp_path),
        timeout=120,
    )
    assert done.returncode == 2
    assert "model-ref-not-found" in done.stderr
    assert Q4_PARTS[0] in done.stderr and Q8 in done.stderr


def test_generate_runs_a_hub_file_as_the_same_file_by_path(hub: HubServer, tmp_path: Path) -> None:
    def text(model: str) -> str:
        done = subprocess.run(
            _meshnet("generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "8"),
            capture_output=True,
            text=True,
            env=_env(hub, tmp_path),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert text(f"hf:{REPO}/{Q8}") == text(str(hub.root / REPO / Q8))
    assert text(f"hf:{REPO}:Q4_K_M") == text(str(unsplit_q4(hub.root)))  # split: its parts


def test_admin_serve_of_a_reference_loads_it_on_empty_nodes(
    hub: HubServer, tmp_path: Path, tiny_path: Path
) -> None:
    before = dict(hub.sent)
    mesh = LocalMesh(
        data_dir=tmp_path / "mesh",
        model=str(tiny_path),
        extra_env=_hub_env(hub, tmp_path),
        tracker_args=["--replicas", "0"],
    )
    try:
        mesh.start([LayerRange(0, 4), None, None])
        body = {"path": f"hf:{REPO}:Q8_0", "nodes": 2}
        hub.throttle(0.05)  # a slow link: the fetch is seen under way
        try:
            with ThreadPoolExecutor(1) as pool:
                served_later = pool.submit(
                    httpx.post,
                    f"{mesh.url}/admin/models",
                    json=body,
                    headers=mesh.admin_headers,
                    timeout=300,
                )
                progress = _fetch_seen(mesh, served_later)
                hub.throttle(0)
                r = served_later.result()
        finally:
            hub.throttle(0)
        assert r.status_code == 201, r.text
        assert progress["ref"] == f"hf:{REPO}:Q8_0"
        assert 0 < progress["done_bytes"] <= progress["total_bytes"]
        served = r.json()
        assert served["name"] == "tiny-Q8_0" and served["complete"]
        r = httpx.post(
            f"{mesh.url}/v1/completions",
            headers=mesh.api_headers,
            timeout=120,
            json={"model": "tiny-Q8_0", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _solo_text(hub.root / REPO / Q8, 8)
    finally:
        mesh.stop()
    size = (hub.root / REPO / Q8).stat().st_size
    fetched = [hub.sent[n] - before.get(n, 0) for n in ("node-1", "node-2")]
    assert all(0 < n < 0.75 * size for n in fetched), (fetched, size)


def test_a_second_node_fetches_its_range_from_the_first_not_the_hub(
    hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    half = N_LAYERS // 2
    mesh = LocalMesh(
        data_dir=tmp_path / "mesh",
        model=f"hf:{REPO}:Q4_K_M",
        extra_env=_hub_env(hub, tmp_path),
        tracker_args=["--replicas", "0"],
    )

    def node(name: str, layers: LayerRange) -> None:
        mesh.start_node(name, layers, extra=["--model-cache", str(tmp_path / name)])

    try:
        mesh.start_tracker()
        node("first", LayerRange(0, half))
        mesh.wait_ready(expected_nodes=1, timeout_s=120, need_route=False)
        node("second", LayerRange(0, half))
        node("tail", LayerRange(half, N_LAYERS))
        mesh.wait_ready(expected_nodes=3, timeout_s=120)
        r = httpx.post(
            f"{mesh.url}/v1/completions",
            headers=mesh.api_headers,
            timeout=120,
            json={"model": "tiny-Q4_K_M", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _solo_text(unsplit_q4(hub.root), 8)
        held = httpx.get(f"{mesh.url}/admin/inventory", headers=mesh.admin_headers, timeout=10)
        assert held.status_code == 200, held.text
        ranges = {n["node_id"]: [s["layers"] for s in n["shards"]] for n in held.json()["nodes"]}
        assert ranges["first"] == [[0, half]] and ranges["second"] == [[0, half]]
        _models_shows_and_prunes(mesh, tmp_path / "first", capsys)
        _widened_from_disk_and_peers(mesh, tmp_path / "second", half)
    finally:
        mesh.stop()
    size = q4_size(hub.root)
    assert 0.3 * size < hub.sent["first"] < 0.6 * size
    assert hub.sent["second"] == 0  # every byte, header included, from the first node
    assert (tmp_path / "second" / "shards").is_dir()


def _models_shows_and_prunes(
    mesh: LocalMesh, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``meshnet models`` lists what each node holds; ``meshnet models prune`` removes a
    shard no node serves and keeps the served one."""
    admin = ["--url", mesh.url, "--admin-token", mesh.credentials.admin_token]
    capsys.readouterr()
    assert main(["models", *admin]) == 0
    shown = capsys.readouterr().out
    assert "held on disk" in shown
    assert [line.split()[:3] for line in shown.splitlines() if line.startswith("first")] == [
        ["first", "tiny-Q4_K_M", f"0:{N_LAYERS // 2}"]
    ]
    served = sorted((cache / "shards").glob("*/*.gguf"))
    assert [p.name for p in served] == [f"0-{N_LAYERS // 2}-{p[-19:]}" for p in Q4_PARTS]
    stale = served[0].with_name("0-1.gguf")
    stale.write_bytes(b"GGUF")
    assert main(["models", "prune", *admin, "--model-cache", str(cache)]) == 0
    assert "removed 1 file(s)" in capsys.readouterr().out
    assert all(p.is_file() for p in served) and not stale.exists()


def _fetch_seen(mesh: LocalMesh, serving: Future[httpx.Response]) -> dict[str, Any]:
    """A node's fetch progress as ``/admin/nodes`` shows it, polled while the serve runs."""
    while not serving.done():
        r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=10)
        for n in r.json()["nodes"]:
            if n["fetching"] and n["fetching"]["done_bytes"] > 0:
                return dict(n["fetching"])
        time.sleep(0.05)
    raise AssertionError(f"no fetch seen under way: {serving.result().text}")


def test_a_node_killed_mid_fetch_resumes_where_it_stopped(hub: HubServer, tmp_path: Path) -> None:
    half = N_LAYERS // 2
    cache = tmp_path / "solo"
    mesh = LocalMesh(
        data_dir=tmp_path / "mesh",
        model=f"hf:{REPO}:Q4_K_M",
        extra_env=_hub_env(hub, tmp_path),
        tracker_args=["--replicas", "0"],
    )
    whole = fetch_size(hub, tmp_path, LayerRange(0, half))
    largest = max(t.nbytes for t in whole.tensors)
    before = hub.sent["solo"]
    try:
        mesh.start_tracker()
        mesh.wait_ready(expected_nodes=0, timeout_s=120, need_route=False)
        hub.throttle(0.2)  # slow enough to be caught midway
        try:
            mesh.start_node("solo", LayerRange(0, half), extra=["--model-cache", str(cache)])
            state = _verified_midway(cache, lambda names: _bytes(whole, names) > 2 * largest)
            mesh.kill_node("solo")
        finally:
            hub.throttle(0)
        cut = hub.sent["solo"] - before
        mesh.start_node("solo", LayerRange(0, half), extra=["--model-cache", str(cache)])
        mesh.start_node("tail", LayerRange(half, N_LAYERS), extra=["--model-cache", str(cache)])
        mesh.wait_ready(expected_nodes=2, timeout_s=120)
    finally:
        mesh.stop()
    resumed = hub.sent["solo"] - before - cut
    # The restarted node fetched none of what was checked before the kill.
    assert resumed < whole.needed - _bytes(whole, state) + largest
    assert cut + resumed < whole.needed + largest  # not fetched twice


def _verified_midway(cache: Path, enough: Callable[[list[str]], bool]) -> list[str]:
    """The tensors a fetch under way has checked, once they are ``enough``."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for state in cache.glob("shards/*/*.state.json"):
            try:
                verified = json.loads(state.read_text())["verified"]
            except (OSError, ValueError):
                continue
            if enough(verified):
                return list(verified)
        time.sleep(0.02)
    raise AssertionError("the fetch was never seen midway")


@dataclass(frozen=True)
class _Needed:
    needed: int  # the header and the range's tensors
    tensors: tuple[TensorHash, ...]


def fetch_size(hub: HubServer, tmp: Path, layers: LayerRange) -> _Needed:
    """What a fetch of ``layers`` reads, from a clean fetch of its own."""
    ref = f"hf:{REPO}:Q4_K_M"
    cfg = SourceConfig(cache_dir=tmp / "clean", client="clean", endpoint=hub.url)
    manifest = tracker_model(ref, cfg).manifest
    shard = fetch_shard(locate(parse_ref(ref), cfg), manifest, layers, cfg)
    header = open_gguf(shard.path)
    kept = tuple(t for t in manifest.tensors if t.name in header.tensors and t.nbytes)
    return _Needed(shard.fetched_bytes, kept)


def _bytes(needed: _Needed, names: list[str]) -> int:
    return sum(t.nbytes for t in needed.tensors if t.name in names)


def _widened_from_disk_and_peers(mesh: LocalMesh, cache: Path, half: int) -> None:
    """``second`` reconfigured from ``[0, half)`` to ``[0, half + 2)``: its layers below
    ``half`` come from its own shard, the two more from ``tail`` (a peer), and its old
    shard file is dropped."""
    old = sorted((cache / "shards").glob("*/*.gguf"))
    body = {"t3": {"layer_start": 0, "layer_end": half + 2}}
    r = httpx.post(
        f"{mesh.url}/admin/nodes/second/configure",
        json=body,
        headers=mesh.admin_headers,
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["applied"], r.text
    now = sorted(p.name for p in (cache / "shards").glob("*/*.gguf"))
    assert now == [f"0-{half + 2}-{p[-19:]}" for p in Q4_PARTS]
    assert not any(p.exists() for p in old)


def test_a_node_fetching_a_range_another_is_fetching_reads_it_from_that_one(
    hub: HubServer, tmp_path: Path
) -> None:
    """A single flight: ``follow`` starts fetching ``lead``'s range while ``lead`` is still
    fetching it from a slow hub; the tracker names ``lead`` to it, and every byte of its
    shard comes from ``lead`` as ``lead`` checks it, none from the hub."""
    half = N_LAYERS // 2
    mesh = LocalMesh(
        data_dir=tmp_path / "mesh",
        model=f"hf:{REPO}:Q4_K_M",
        extra_env=_hub_env(hub, tmp_path),
        tracker_args=["--replicas", "0"],
    )

    def node(name: str, layers: LayerRange) -> None:
        mesh.start_node(name, layers, extra=["--model-cache", str(tmp_path / name)])

    before = dict(hub.sent)
    try:
        mesh.start_tracker()
        mesh.wait_ready(expected_nodes=0, timeout_s=120, need_route=False)
        hub.throttle(2.0)  # slow: lead is midway when follow begins (then fast again)
        try:
            node("lead", LayerRange(0, half))
            _verified_midway(tmp_path / "lead", lambda names: len(names) > 0)
            node("follow", LayerRange(0, half))
            _verified_midway(tmp_path / "follow", lambda names: len(names) > 0)
            # follow has checked tensors while lead's shard was not whole yet
            assert list((tmp_path / "lead").glob("shards/*/*.partial"))
        finally:
            hub.throttle(0)
        node("tail", LayerRange(half, N_LAYERS))
        mesh.wait_ready(expected_nodes=3, timeout_s=120)
        r = httpx.post(
            f"{mesh.url}/v1/completions",
            headers=mesh.api_headers,
            timeout=120,
            json={"model": "tiny-Q4_K_M", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _solo_text(unsplit_q4(hub.root), 8)
    finally:
        hub.throttle(0)
        mesh.stop()
    sent = {k: v - before.get(k, 0) for k, v in hub.sent.items()}
    size = q4_size(hub.root)
    assert 0.3 * size < sent["lead"] < 0.6 * size
    assert sent.get("follow", 0) == 0  # the hub gave its range once, to lead
    assert len(list((tmp_path / "follow").glob("shards/*/*.gguf"))) == len(Q4_PARTS)
