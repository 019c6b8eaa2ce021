"""The operator commands against a real mesh: `meshnet nodes | sessions | ledger | billing | models`
print what the tracker knows, as tables or JSON, and refuse without the admin token;
`meshnet nodes readmit` says why the tracker refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import MeshFactory

from meshnet.cli.main import main
from meshnet.local_mesh import LocalMesh


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    """A two-node mesh that has answered a completion and holds one session."""
    mesh = mesh_factory("0:2,2:4", model=tiny_path)
    r = httpx.post(
        f"{mesh.url}/v1/completions",
        headers=mesh.api_headers,
        json={"model": "tiny", "prompt": "the", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200
    r = httpx.post(f"{mesh.url}/v1/sessions", headers=mesh.api_headers, json={}, timeout=30)
    assert r.status_code == 200
    return mesh


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHNET_ADMIN_TOKEN", raising=False)


def _run(capsys: pytest.CaptureFixture[str], mesh: LocalMesh, *argv: str) -> str:
    command, *rest = argv
    status = main([command, "--url", mesh.url, "--data-dir", str(mesh.data_dir), *rest])
    out = capsys.readouterr().out
    assert status == 0, out
    return out


def _rows(table: str) -> dict[str, list[str]]:
    """The rows of a table by their first cell."""
    return {line.split()[0]: line.split() for line in table.splitlines()[1:] if line.strip()}


def test_nodes(mesh: LocalMesh, capsys: pytest.CaptureFixture[str]) -> None:
    table = _run(capsys, mesh, "nodes")
    assert table.splitlines()[0].split()[:4] == ["NODE", "STATE", "LAYERS", "ADDRESS"]
    rows = _rows(table)
    assert rows["node-0"][1:3] == ["up", "0:2"] and rows["node-1"][1:3] == ["up", "2:4"]
    nodes = json.loads(_run(capsys, mesh, "nodes", "--json"))["nodes"]
    assert {n["node_id"] for n in nodes} == {"node-0", "node-1"}


def test_models(mesh: LocalMesh, capsys: pytest.CaptureFixture[str]) -> None:
    row = _rows(_run(capsys, mesh, "models"))["tiny"]
    assert row[1:4] == ["4", "1", "complete"]
    (model,) = json.loads(_run(capsys, mesh, "models", "--json"))["models"]
    assert model["name"] == "tiny" and model["replicas"] == [1, 1, 1, 1]


def test_sessions(mesh: LocalMesh, capsys: pytest.CaptureFixture[str]) -> None:
    table = _run(capsys, mesh, "sessions")
    assert "STATE" in table and "running now:" in table and "GENERATION" in table
    answer = json.loads(_run(capsys, mesh, "sessions", "--json"))
    assert sum(answer["sessions"].values()) >= 1 and answer["generations"] == []
    (listed,) = answer["listed"]  # the one session the fixture opened, found by the listing
    assert listed["state"] == "idle" and listed["model"] == "tiny"
    assert listed["id"] in table
    assert json.loads(_run(capsys, mesh, "sessions", "--json", "--state", "parked"))["listed"] == []


def test_ledger(mesh: LocalMesh, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(_run(capsys, mesh, "ledger"))
    assert int(rows["node-0"][1]) >= 1 and int(rows["node-1"][1]) >= 1  # completed attempts
    with_records = _run(capsys, mesh, "ledger", "--records", "--node", "node-1")
    records = with_records.split("\n\n")[1]
    assert "completed" in records and "2:4" in records and "node-0" not in records


def test_billing(mesh: LocalMesh, capsys: pytest.CaptureFixture[str]) -> None:
    tenants, nodes = _run(capsys, mesh, "billing").split("\n\n")
    default = _rows(tenants)["default"]
    assert int(default[1]) >= 1 and int(default[2]) >= 1  # generations, billable tokens
    assert set(_rows(nodes)) >= {"node-0", "node-1"}
    answer = json.loads(_run(capsys, mesh, "billing", "--json"))
    assert {t["tenant"] for t in answer["tenants"]} >= {"default"}


def test_readmit_refuses_a_node_that_is_not_quarantined(
    mesh: LocalMesh, capsys: pytest.CaptureFixture[str]
) -> None:
    """(A quarantined node readmitted: tests/e2e/test_verified_work.py.)"""
    argv = ["nodes", "readmit", "node-0", "--url", mesh.url, "--data-dir", str(mesh.data_dir)]
    assert main(argv) == 2
    assert "node node-0 is up: only a quarantined node is readmitted" in capsys.readouterr().err
    assert main([*argv[:2], "nobody", *argv[3:]]) == 2
    assert "no node 'nobody' is registered" in capsys.readouterr().err
    assert _rows(_run(capsys, mesh, "nodes"))["node-0"][1] == "up"


def test_the_commands_refuse_without_the_admin_token(
    mesh: LocalMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("nodes", "sessions", "ledger", "billing", "models"):
        status = main([command, "--url", mesh.url, "--data-dir", str(tmp_path)])
        assert status == 2
        assert "needs the admin token" in capsys.readouterr().err
    wrong = main(["nodes", "--url", mesh.url, "--admin-token", "ma_" + "0" * 64])
    assert wrong == 2 and "refused the admin token" in capsys.readouterr().err
    api_key = mesh.credentials.api_key  # a tenant's key is not the admin token
    assert main(["ledger", "--url", mesh.url, "--admin-token", api_key]) == 2


def test_a_command_run_as_a_process_with_the_token_in_the_environment(mesh: LocalMesh) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "meshnet.cli.main", "nodes", "--url", mesh.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MESHNET_ADMIN_TOKEN": mesh.credentials.admin_token},
        cwd=mesh.data_dir.parent,  # no meshnet-data here: the token comes from the environment
    )
    assert run.returncode == 0, run.stderr
    assert "node-0" in run.stdout and "node-1" in run.stdout
