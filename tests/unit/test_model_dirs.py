"""A node loads models only from its model directories, and says nothing of other paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnet.errors import PermissionDenied
from meshnet.node.model_dirs import ModelDirs


def test_only_files_under_the_model_directories_resolve(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").write_bytes(b"x")
    (tmp_path / "secret").write_text("s")
    (models / "link.gguf").symlink_to(tmp_path / "secret")
    dirs = ModelDirs.of([models])
    assert dirs.resolve(str(models / "m.gguf")) == str((models / "m.gguf").resolve())
    messages = set()
    for outside in (
        tmp_path / "secret",  # exists
        tmp_path / "missing",  # does not
        models / ".." / "secret",
        models / "link.gguf",  # a link out of the directory
        Path("/etc/passwd"),
    ):
        with pytest.raises(PermissionDenied) as refused:
            dirs.resolve(str(outside))
        messages.add(refused.value.message)
    assert len(messages) == 1  # the same words whether or not the path exists


def test_a_sibling_with_the_same_prefix_is_outside(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models2").mkdir()
    (tmp_path / "models2" / "m.gguf").write_bytes(b"x")
    with pytest.raises(PermissionDenied):
        ModelDirs.of([tmp_path / "models"]).resolve(str(tmp_path / "models2" / "m.gguf"))
