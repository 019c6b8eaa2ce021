"""The import contract (pyproject.toml's ``[tool.importlinter]``, docs/design.md §3) holds
for the tree, and fails on a copy of it with one import that crosses it.

``lint-imports`` reads the source (it imports nothing), so a copy of ``src/meshnet`` with
one line added is enough; its ``PYTHONPATH`` points it at that copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(src: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contract over the package under ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of ``src/meshnet`` in which ``module`` (a path under it) ends with ``line``."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "src" / "meshnet",
        src / "meshnet",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    path = src / "meshnet" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return src


def test_the_tree_keeps_the_contract(tmp_path: Path) -> None:
    done = _lint(ROOT / "src", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # the model's math importing the node: a lower layer climbing
        ("model/spec.py", "import meshnet.node.engine", "the layers of meshnet"),
        # node and tracker are siblings that never import each other
        ("node/wire.py", "from meshnet.tracker import service", "the layers of meshnet"),
        # a low room of the tracker importing a high one
        (
            "tracker/storage/database.py",
            "import meshnet.tracker.routing.driver",
            "the tracker's rooms",
        ),
        # the product importing its harness
        (
            "cli/node.py",
            "import meshnet.benchmark.figures",
            "the product never imports its benchmark harness",
        ),
        # a circle inside one package: tiers sits below configure, which imports it
        ("node/tiers.py", "import meshnet.node.configure", "no import circles"),
    ],
    ids=["climbing", "siblings", "tracker-rooms", "harness", "circle"],
)
def test_one_crossing_import_breaks_the_contract(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    done = _lint(_copy_with(tmp_path, module, line), tmp_path)
    assert done.returncode != 0, done.stdout
    verdicts = [row.rstrip() for row in done.stdout.splitlines() if row.startswith(broken)]
    assert verdicts and " BROKEN" in verdicts[0], done.stdout
