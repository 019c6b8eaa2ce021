"""Shared fixtures: a tiny GGUF written per session, and the bundled model when installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tinymodel import TinyConfig, write_tiny_gguf

from meshnet.engine.local import LocalModel, load_local_model

ORACLE = Path(__file__).parent / "fixtures" / "oracle.json"


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny(tiny_path: Path) -> LocalModel:
    return load_local_model(tiny_path)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Write a tiny GGUF with the given config changes; returns its path."""

    def make(name: str, **changes: Any) -> Path:
        return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / name, TinyConfig(**changes))

    return make


@pytest.fixture(scope="session")
def oracle() -> dict[str, Any]:
    """Reference outputs of an fp32 implementation for the bundled model (shared/reference)."""
    return json.loads(ORACLE.read_text())


@pytest.fixture(scope="session")
def bundled() -> LocalModel:
    return load_local_model()
