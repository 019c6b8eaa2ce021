"""Every other path under ``/v1``: an OpenAI-shaped 404 (``/v1/embeddings``…), after
the caller's credential is checked like on every endpoint of the API.

Its router goes last, so it answers only what no other route takes; a path that
another route serves with other methods stays a 405.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.routing import Match

from meshnet.api.caller import AnyCaller
from meshnet.errors import NotFound

router = APIRouter()
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@router.api_route("/v1/{path:path}", methods=_METHODS, include_in_schema=False)
async def missing(path: str, request: Request, caller: AnyCaller) -> None:
    for route in request.app.router.routes:  # this route matches fully: others, partly
        if route.matches(request.scope)[0] is Match.PARTIAL:
            raise HTTPException(405, f"{request.method} is not allowed on /v1/{path}")
    raise NotFound(f"this mesh serves no endpoint /v1/{path} ({request.method})")
