"""Shared fixtures: a tiny GGUF written per session, and the bundled model when installed."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import postgres_server
import pytest
from tinymodel import TinyConfig, write_tiny_gguf

from meshnet.engine.local import LocalModel, load_local_model

ORACLE = Path(__file__).parent / "fixtures" / "oracle.json"


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny(tiny_path: Path) -> LocalModel:
    """The tiny model on the default backend (q8), as nodes run it unless told."""
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
    """The bundled model on the default backend (q8), as nodes run it unless told: the
    in-process answer a default mesh's is compared with. Not the fp32 oracle's numerics:
    tests against ``oracle`` run on ``fast`` (float32 activations)."""
    return load_local_model()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server for the whole run (installed by .ci/run; skipped where absent)."""
    if not postgres_server.available():
        pytest.skip("PostgreSQL is not installed here; .ci/run installs it")
    with postgres_server.postgres() as url:
        yield url


@pytest.fixture
def fresh_postgres(postgres_url: str) -> str:
    """A new, empty database on the test server; its URL."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_url.rsplit("/", 1)[0] + f"/{name}"
