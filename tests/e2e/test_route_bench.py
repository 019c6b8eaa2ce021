"""Route benchmarks on real processes: ``meshnet bench --route`` has the tracker time a
1-node and a 2-node route, every figure is recorded with outputs equal to the unpinned
run's, the record survives a tracker restart, and bad or oversized runs are refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from session_client import TrackerApi
from streams import stream_completion

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.serving.route_bench import MAX_ROUNDS

PROMPT = "the cat sat on"
FIGURES = ("ttft_ms", "token_ms_median", "token_ms_p90", "tokens_per_s")


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:4,0:2,2:4", model=tiny_path)


def _bench_cli(mesh: LocalMesh, *routes: str, tokens: int = 12, rounds: int = 2) -> Any:
    argv = [sys.executable, "-m", "meshnet.cli.main", "bench", "--url", mesh.url]
    argv += ["--data-dir", str(mesh.data_dir), "--prompt", PROMPT, "--json"]  # the admin token
    argv += ["--decode-tokens", str(tokens), "--rounds", str(rounds)]
    for route in routes:
        argv += ["--route", route]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def _listed(mesh: LocalMesh, **params: Any) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{mesh.url}/admin/benchmarks", params=params, headers=mesh.admin_headers, timeout=30
    )
    assert r.status_code == 200, r.text
    return list(r.json()["benchmarks"])


def _post(mesh: LocalMesh, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return httpx.post(
        f"{mesh.url}/admin/benchmarks",
        json=body,
        headers=mesh.admin_headers if headers is None else headers,
        timeout=120,
    )


def _restart_tracker(mesh: LocalMesh, extra_args: Sequence[str] = ()) -> None:
    """Stop the tracker and start it again on the same database (the nodes stay up)."""
    assert mesh.tracker is not None
    mesh.tracker.terminate()
    mesh.tracker.wait(timeout=30)
    mesh.tracker_args = [*mesh.tracker_args, *extra_args]
    mesh.start_tracker()
    mesh.wait_ready(expected_nodes=3, timeout_s=60)


def test_a_1_node_and_a_2_node_route_are_recorded_and_survive_a_restart(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    done = _bench_cli(mesh, "node-0", "node-1,node-2")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    prompt_ids = tiny.tokenizer.encode(PROMPT)
    unpinned = generate(tiny.chain, tiny.tokenizer, prompt_ids, SamplingParams(max_tokens=12)).ids
    assert report["reference"]["ids"] == unpinned
    results = report["results"]
    assert [r["nodes"] for r in results] == [["node-0"], ["node-1", "node-2"]]
    assert [h["layers"] for h in results[1]["route"]] == [[0, 2], [2, 4]]
    assert results[0]["route"] == [{"node_id": "node-0", "layers": [0, 4]}]
    nodes = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
    for r in results:
        assert r["run_id"] == report["run_id"] and r["output_equal"] is True
        assert (r["rounds"], r["max_tokens"], r["tokens"]) == (2, 12, len(unpinned))
        assert r["prompt_tokens"] == len(prompt_ids) and r["model"] == "tiny"
        assert r["fingerprint"] == nodes[0]["fingerprint"] and len(r["fingerprint"]) == 64
        assert all(isinstance(r[f], float) and r[f] > 0 for f in FIGURES), r
        assert r["token_ms_median"] <= r["token_ms_p90"]
    assert _listed(mesh, run_id=report["run_id"]) == results
    _restart_tracker(mesh)
    assert _listed(mesh, run_id=report["run_id"]) == results
    assert _listed(mesh)[-2:] == results  # the latest, oldest first


def test_the_cli_prints_a_table(mesh: LocalMesh) -> None:
    argv = [sys.executable, "-m", "meshnet.cli.main", "bench", "--url", mesh.url, "--rounds", "1"]
    argv += ["--data-dir", str(mesh.data_dir), "--decode-tokens", "4", "--route", "node-0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run ") and "ttft ms" in lines[1]
    assert lines[2].startswith("node-0[0,4]") and lines[2].endswith("yes")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"routes": [["node-0"], ["node-9"]]}, "unknown node ids: node-9"),
        ({"routes": [["node-1"]]}, "layers [0, 2) do not cover [0, 4)"),
        ({"routes": [["node-0"]], "rounds": MAX_ROUNDS + 1}, "rounds:"),
        ({"routes": [], "rounds": 1}, "routes:"),
        ({"routes": [["node-0"]], "max_tokens": 300}, "prompt ("),  # past the context
        ({"routes": [["node-0"]], "prompt": ""}, "prompt:"),
    ],
)
def test_a_bad_run_is_400_with_its_reason_and_records_nothing(
    mesh: LocalMesh, body: dict[str, Any], reason: str
) -> None:
    before = _listed(mesh)
    r = _post(mesh, {"prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(reason), r.text
    assert _listed(mesh) == before


def test_only_the_admin_runs_or_lists_benchmarks(mesh: LocalMesh) -> None:
    body = {"routes": [["node-0"]], "prompt": PROMPT}
    assert _post(mesh, body, headers=mesh.api_headers).status_code == 401
    r = httpx.get(f"{mesh.url}/admin/benchmarks", headers=mesh.api_headers)
    assert r.status_code == 401
    argv = [sys.executable, "-m", "meshnet.cli.main", "bench", "--url", mesh.url]
    argv += ["--admin-token", "ma_wrong", "--route", "node-0"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "unauthenticated" in refused.stderr


def test_a_benchmark_takes_capacity_like_any_generation(mesh: LocalMesh) -> None:
    """With one generation allowed in flight and it held, the run is told to come back."""
    _restart_tracker(mesh, ["--max-in-flight", "1"])
    admin = TrackerApi(mesh.url, mesh.admin_headers)
    hold = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "meshnet": {"route": ["node-0"]}}
    before = _listed(mesh)

    def stall(n: int, _: Any) -> bool:
        if n != 1:
            return False
        mesh.kill_node("node-0", signal.SIGSTOP)  # the generation stays in flight
        try:
            r = _post(mesh, {"routes": [["node-1", "node-2"]], "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]
        finally:
            mesh.nodes["node-0"].send_signal(signal.SIGCONT)
        return True

    held = stream_completion(admin, hold, on_token=stall)
    assert held.hung_up
    assert _listed(mesh) == before
