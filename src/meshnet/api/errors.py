"""Every error leaves the API in the OpenAI error shape, with its stable kind as ``code``.

Bad input is 400 (FastAPI's own validation errors included, never 422 or 500),
an unknown model 404, no capacity 429, no complete route or no database 503;
every 429 and every retryable 503 says when to come back (``Retry-After``). A
fault of the tracker's database or disk (full, over quota, over its file-size
limit, failing) that reaches the edge untyped is answered as the typed 503 it
is (``database-unavailable``), never a plain 500.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshnet.errors import MeshnetError, RequestError
from meshnet.tracker.storage.database import unavailable

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    409: "conflict_error",
    410: "gone_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
}


def http_status(e: MeshnetError) -> int:
    """The status a client sees. A node's complaint (a malformed bundle, a shard
    mismatch…) is never the client's fault: it is a 502, unless it says there is no
    capacity (429) or no route (503)."""
    if e.node_id and e.http_status < 500 and e.http_status != 429:
        return 502
    return e.http_status


def retry_headers(e: MeshnetError) -> dict[str, str]:
    """``Retry-After`` (seconds) on every 429 and every retryable 503: when to come back."""
    status = http_status(e)
    if status != 429 and not (status == 503 and e.retryable):
        return {}
    return {"Retry-After": str(max(1, int(getattr(e, "retry_after_s", 1))))}


def error_body(e: MeshnetError) -> dict[str, Any]:
    param = e.param if isinstance(e, RequestError) else None
    body = _body(http_status(e), e.message, e.kind, param)
    body["error"].update(e.details())
    return body


def _body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MeshnetError)
    async def _meshnet(request: Request, e: MeshnetError) -> JSONResponse:
        status = http_status(e)
        if status >= 500:
            log.warning("%s %s failed: %s", request.method, request.url.path, e)
        return JSONResponse(error_body(e), status_code=status, headers=retry_headers(e))

    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.Error)
    async def _storage(request: Request, e: Exception) -> JSONResponse:
        typed = unavailable(e)
        if typed is None:  # not the disk or the database: a bug, said as one
            log.error("%s %s failed", request.method, request.url.path, exc_info=e)
            return JSONResponse(_body(500, "internal error", "internal"), status_code=500)
        return await _meshnet(request, typed)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid body"
        return JSONResponse(_body(400, message, "bad-request", where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            _body(e.status_code, str(e.detail), "http-error"), status_code=e.status_code
        )
