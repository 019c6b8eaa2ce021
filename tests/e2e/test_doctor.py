"""`meshnet doctor` against a real tracker (LocalMesh, the tiny model): a good setup passes,
each broken one fails with its own line; `meshnet node` refuses to start with the same line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MeshFactory

from meshnet.auth.keys import MESH_SECRET_FILE, new_secret
from meshnet.cli.main import main
from meshnet.local_mesh import LocalMesh, free_port


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:4", model=tiny_path)


def _flags(mesh: LocalMesh, model: Path, *extra: str) -> list[str]:
    """A good setup of a second node of ``mesh``, changed by ``extra`` (argparse keeps
    the last of a repeated flag)."""
    secret = str(mesh.data_dir / MESH_SECRET_FILE)
    return [
        "--tracker",
        mesh.url,
        "--model",
        str(model),
        "--layers",
        "0:2",
        "--node-id",
        "doctor-1",
        "--mesh-secret-file",
        secret,
        *extra,
    ]


def _doctor(capsys: pytest.CaptureFixture[str], flags: list[str]) -> tuple[int, list[str]]:
    status = main(["doctor", "--check-timeout", "5", *flags])
    return status, capsys.readouterr().out.splitlines()


def _name(line: str) -> str:
    """The check a line is of (``Check.line``: status, two spaces, the name in 18)."""
    return line[6:24].strip()


def _failed(lines: list[str]) -> list[str]:
    return [_name(line) for line in lines if line.startswith("FAIL")]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def test_a_good_setup_passes_as_a_command(mesh: LocalMesh, tiny_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "meshnet.cli.main", "doctor", *_flags(mesh, tiny_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines[-1] == "every check passed"
    checks = lines[:-1]
    assert all(line.startswith("ok ") for line in checks), checks
    names = {_name(line) for line in checks}
    expected = {"model file", "architecture", "tokenizer", "layers", "tensors", "sha256"}
    expected |= {"memory", "park dir", "listen", "advertise", "tracker", "tracker model"}
    assert expected | {"credential", "tracker key"} <= names


@pytest.mark.parametrize(
    ("change", "check", "words"),
    [
        (["--model", "/nowhere/missing.gguf"], "model file", "no such model file"),
        (["--layers", "0:9"], "layers", "outside the model's 4 layers"),
        (["--tracker", "http://127.0.0.1:{free}"], "tracker", "Connection refused"),
        (["--listen", "0.0.0.0:0"], "advertise", "dial 0.0.0.0"),
        (["--node-key-file", "{bad_key}"], "tracker key", "refuses node doctor-1's key"),
        (["--park-dir", "{file}/parked"], "park dir", "cannot be written"),
    ],
)
def test_a_broken_setup_fails_its_check(
    mesh: LocalMesh,
    tiny_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: list[str],
    check: str,
    words: str,
) -> None:
    (tmp_path / "bad.key").write_text(new_secret() + "\n")
    (tmp_path / "file").write_text("")
    values: dict[str, Any] = {
        "free": free_port(),
        "bad_key": tmp_path / "bad.key",
        "file": tmp_path / "file",
    }
    status, lines = _doctor(capsys, _flags(mesh, tiny_path, *[c.format(**values) for c in change]))
    assert status == 1
    (line,) = [line for line in lines if line.startswith("FAIL")]
    assert _name(line) == check and words in line and "; fix: " in line


def test_an_unbindable_listen_port(
    mesh: LocalMesh, tiny_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = _doctor(capsys, _flags(mesh, tiny_path, "--listen", f"127.0.0.1:{busy_port}"))
    assert status == 1 and _failed(lines) == ["listen"]


def test_an_unsupported_architecture(
    mesh: LocalMesh, tiny_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = _doctor(capsys, _flags(mesh, tiny_factory("mamba.gguf", architecture="mamba")))
    assert status == 1 and _failed(lines) == ["architecture"]


def test_a_tracker_serving_another_model(
    mesh: LocalMesh, tiny_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = _doctor(capsys, _flags(mesh, tiny_factory("other.gguf", seed=5)))
    assert status == 1 and _failed(lines) == ["tracker model"]
    (line,) = [line for line in lines if line.startswith("FAIL")]
    assert "serves 'tiny', this node 'other'" in line


def test_a_node_refuses_to_start_with_the_same_line(
    mesh: LocalMesh, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _flags(mesh, tiny_path, "--layers", "1:7")
    _, doctor_lines = _doctor(capsys, flags)
    node = subprocess.run(
        [sys.executable, "-m", "meshnet.cli.main", "node", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert node.returncode == 2
    failed = [line for line in doctor_lines if line.startswith("FAIL")]
    assert failed and all(line in node.stderr.splitlines() for line in failed)
    assert "not starting" in node.stderr
