"""A node's HTTP calls to the tracker (registration, heartbeats), signed with its key."""

from __future__ import annotations

from collections.abc import Generator

import httpx

from meshnet.auth.signing import sign_request


class NodeAuth(httpx.Auth):
    """Signs each request's method, path, time and body as node ``node_id``."""

    requires_request_body = True

    def __init__(self, node_id: str, key: str) -> None:
        self._node_id = node_id
        self._key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        path = request.url.raw_path.decode().split("?", 1)[0]
        request.headers["Authorization"] = sign_request(
            self._node_id, self._key, request.method, path, request.content
        )
        yield request
