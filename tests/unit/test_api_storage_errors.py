"""A fault of the tracker's database or disk reaches a client as a typed 503 with
``Retry-After``, never a plain 500 (api/errors.py)."""

from __future__ import annotations

import errno
import sqlite3

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from meshnet.api.errors import install_error_handlers, retry_headers
from meshnet.errors import DatabaseUnavailable, NoRoute, Overloaded, RequestError


def app_raising(error: BaseException) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise error

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    "error",
    [
        DatabaseUnavailable("PostgreSQL: server closed the connection"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        OSError(errno.EFBIG, "File too large"),
        sqlite3.OperationalError("database or disk is full"),
    ],
    ids=["typed", "ENOSPC", "EDQUOT", "EFBIG", "sqlite-untyped"],
)
def test_a_storage_fault_is_a_typed_503_with_retry_after(error: BaseException) -> None:
    r = app_raising(error).get("/boom")
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "1"
    body = r.json()["error"]
    assert body["code"] == "database-unavailable" and body["type"] == "service_unavailable"


def test_another_os_error_is_a_500_in_the_api_shape() -> None:
    r = app_raising(OSError(errno.ENOENT, "No such file")).get("/boom")
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal"


def test_retry_after_on_every_429_and_retryable_503_only() -> None:
    assert retry_headers(NoRoute("none")) == {"Retry-After": "1"}
    assert retry_headers(Overloaded("busy", retry_after_s=7)) == {"Retry-After": "7"}
    assert retry_headers(RequestError("bad")) == {}
