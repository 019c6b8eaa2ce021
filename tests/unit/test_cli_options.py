"""Shared flags: what `meshnet up` is given reaches `meshnet node` and `meshnet tracker`
with the same values; each node's kernel threads, split or given; the command lines
`LocalMesh` writes, read from a fake `Popen`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshnet import local_mesh
from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.cli import up
from meshnet.cli.main import build_parser
from meshnet.cli.options import declare_node_options, declare_tracker_options, given_argv
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, split_threads
from meshnet.node.main import available_cores


def _sample_argv(declare: Any) -> list[str]:
    """Every flag of ``declare`` with a value other than its default."""
    argv: list[str] = []
    for action in declare(argparse.ArgumentParser(add_help=False)):
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
        elif action.choices:
            argv += [flag, next(c for c in action.choices if c != action.default)]
        elif action.type is float:
            argv += [flag, "1.5"]
        elif action.type is not None:  # int and positive_int
            argv += [flag, "3"]
        else:
            argv += [flag, "postgresql://example/db"]
    return argv


def _up(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def _shared(args: argparse.Namespace, declare: Any) -> dict[str, Any]:
    names = {a.dest for a in declare(argparse.ArgumentParser(add_help=False))}
    return {k: v for k, v in vars(args).items() if k in names}


def test_every_node_option_up_is_given_reaches_the_node_unchanged() -> None:
    given = _up(*_sample_argv(declare_node_options))
    node_argv = given_argv(declare_node_options, given)
    node = build_parser().parse_args(["node", "--tracker", "http://t", "--empty", *node_argv])
    assert _shared(node, declare_node_options) == _shared(given, declare_node_options)
    assert node.backend == given.backend != DEFAULT_BACKEND
    assert node.kv_budget_mb == 1.5 and node.threads == 3


def test_every_tracker_option_up_is_given_reaches_the_tracker_unchanged() -> None:
    given = _up(*_sample_argv(declare_tracker_options))
    tracker = build_parser().parse_args(["tracker", *given_argv(declare_tracker_options, given)])
    assert _shared(tracker, declare_tracker_options) == _shared(given, declare_tracker_options)
    assert tracker.relay is False and tracker.step_timeout == 1.5 and tracker.max_recoveries == 3


def test_up_passes_only_what_it_was_given() -> None:
    mesh = up.local_mesh(_up("--prefill-chunk", "64", "--park-after", "0"), Path("/nowhere"))
    assert mesh.node_args == ["--prefill-chunk", "64"]
    assert mesh.tracker_args == ["--park-after", "0.0"]
    bare = up.local_mesh(_up(), Path("/nowhere"))
    assert bare.node_args == [] and bare.tracker_args == []


def test_threads_are_not_passed_as_a_node_flag_but_as_each_nodes_share() -> None:
    args = _up("--threads", "2", "--backend", "numpy")
    assert up.local_mesh(args, Path("/nowhere")).node_args == ["--backend", "numpy"]
    assert up.node_threads(args, 3) == [2, 2, 2]


def test_without_threads_up_splits_the_cores_available_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up, "available_cores", lambda: 8)
    assert up.node_threads(_up(), 3) == [3, 3, 2]
    monkeypatch.setattr(up, "available_cores", lambda: 2)
    assert up.node_threads(_up(), 3) == [1, 1, 1]


@pytest.mark.parametrize(
    ("cores", "nodes", "shares"),
    [
        (2, 1, [2]),
        (2, 2, [1, 1]),
        (2, 3, [1, 1, 1]),
        (5, 2, [3, 2]),
        (16, 4, [4] * 4),
        (0, 2, [1, 1]),
    ],
)
def test_split_threads_gives_every_core_and_each_node_at_least_one(
    cores: int, nodes: int, shares: list[int]
) -> None:
    assert split_threads(cores, nodes) == shares


def test_a_node_defaults_to_the_cores_available_to_it() -> None:
    assert build_parser().parse_args(["node", "--tracker", "t", "--empty"]).threads is None
    assert available_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", ["0", "-2", "many"])
def test_threads_must_be_a_positive_count(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--tracker", "t", "--empty", "--threads", bad])
    assert "--threads" in capsys.readouterr().err


def _record_starts(monkeypatch: pytest.MonkeyPatch) -> list[SimpleNamespace]:
    """Replace ``Popen`` with a recorder: the list of what would have been started."""
    started: list[SimpleNamespace] = []

    def fake_popen(cmd: list[str], env: dict[str, str], **_: Any) -> SimpleNamespace:
        started.append(SimpleNamespace(cmd=cmd, env=env))
        return started[-1]

    monkeypatch.setattr(local_mesh.subprocess, "Popen", fake_popen)
    return started


def test_local_mesh_gives_each_node_its_threads_as_flag_and_pool_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started = _record_starts(monkeypatch)
    mesh = LocalMesh(tmp_path, port=1, node_args=["--prefill-chunk", "64"])
    mesh.start_tracker()
    mesh.start_node("a", LayerRange(0, 2), threads=3)
    mesh.start_node("b", None)
    tracker, a, b = started
    assert tracker.env["NUMBA_NUM_THREADS"] == "1"
    assert a.env["NUMBA_NUM_THREADS"] == "3" and _flag(a.cmd, "--threads") == "3"
    assert b.env["NUMBA_NUM_THREADS"] == "1" and _flag(b.cmd, "--threads") == "1"
    assert _flag(a.cmd, "--prefill-chunk") == "64" and _flag(b.cmd, "--prefill-chunk") == "64"
    assert a.env["OPENBLAS_NUM_THREADS"] == "1"


def _flag(cmd: list[str], flag: str) -> str:
    """The value of the last ``flag`` in ``cmd`` (argparse takes the last one)."""
    return cmd[len(cmd) - cmd[::-1].index(flag)]


def test_a_nodes_metrics_port_is_a_port_or_off() -> None:
    parser = build_parser()
    base = ["node", "--tracker", "http://127.0.0.1:1", "--empty"]
    assert parser.parse_args(base).metrics_port == 0  # any free port
    assert parser.parse_args([*base, "--metrics-port", "9100"]).metrics_port == 9100
    assert parser.parse_args([*base, "--metrics-port", "off"]).metrics_port is None
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--metrics-port", "70000"])
