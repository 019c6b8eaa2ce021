"""``memory.in_child``: a check run in a forked child answers as if run here, and what it
loads stays out of this process."""

from __future__ import annotations

import os
import sys

import pytest

from meshnet.errors import MeshnetError, ModelError
from meshnet.memory import in_child


def _import_and_answer() -> tuple[int, bool]:
    import tomllib  # noqa: F401  # loaded in the child only

    return os.getpid(), "tomllib" in sys.modules


def _refuse() -> None:
    raise ModelError("architecture 'mamba' is not supported")


def _die() -> None:
    os._exit(3)


def _unpicklable() -> object:
    return lambda: None


def test_the_answer_comes_from_a_child_whose_imports_stay_there() -> None:
    sys.modules.pop("tomllib", None)
    pid, imported = in_child(_import_and_answer)
    assert pid != os.getpid() and imported
    assert "tomllib" not in sys.modules


def test_the_childs_exception_is_raised_here_with_its_type() -> None:
    with pytest.raises(ModelError, match="'mamba' is not supported"):
        in_child(_refuse)


def test_a_child_that_dies_without_an_answer_is_a_typed_error() -> None:
    with pytest.raises(MeshnetError, match="exit status 3"):
        in_child(_die)


def test_an_answer_that_cannot_be_sent_back_is_a_typed_error() -> None:
    with pytest.raises(MeshnetError, match="cannot be sent back"):
        in_child(_unpicklable)
