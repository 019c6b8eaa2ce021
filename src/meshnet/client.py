"""A small client for a running mesh's chat API (used by ``meshnet chat`` and ``up --once``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from meshnet.errors import MeshnetError, Unauthenticated


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def served_model(url: str, api_key: str) -> str:
    r = httpx.get(f"{url}/v1/models", headers=_auth(api_key), timeout=10.0)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def stream_chat(
    url: str,
    api_key: str,
    messages: list[dict[str, str]],
    max_tokens: int = 256,
    temperature: float = 0.0,
    seed: int | None = None,
    timeout_s: float = 600.0,
) -> Iterator[str]:
    """Yield the assistant's text as it streams; raise ``MeshnetError`` on an API error."""
    body: dict[str, Any] = {
        "model": served_model(url, api_key),
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if seed is not None:
        body["seed"] = seed
    chat = f"{url}/v1/chat/completions"
    with httpx.stream("POST", chat, json=body, headers=_auth(api_key), timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise MeshnetError(f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise MeshnetError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                if text := choice.get("delta", {}).get("content"):
                    yield text


class AdminClient:
    """The tracker's admin endpoints (``/admin/...``), called with the admin token.

    Used by the operator commands (``meshnet nodes | sessions | ledger | models``).
    A refused token is ``Unauthenticated``; a tracker that cannot be reached, or
    answers anything but 200, a ``MeshnetError`` saying so.
    """

    def __init__(
        self,
        url: str,
        admin_token: str,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers=_auth(admin_token), timeout=timeout_s, transport=transport
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def get(self, path: str, **params: str | int | float) -> dict[str, Any]:
        """The JSON object ``GET path`` answers."""
        return self.send("GET", path, None, None, **params)

    def send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        **params: str | int | float,
    ) -> dict[str, Any]:
        """The JSON object ``METHOD path`` answers (any 2xx); ``timeout_s`` for a call
        that waits on the mesh (a model load)."""
        timeout = self._http.timeout if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            r = self._http.request(method, path, params=params, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise MeshnetError(f"cannot reach the tracker at {self.url}: {e}") from None
        if r.status_code in (401, 403):
            raise Unauthenticated(f"the tracker at {self.url} refused the admin token")
        if not 200 <= r.status_code < 300:
            raise MeshnetError(f"{path}: HTTP {r.status_code}: {_error_message(r)}")
        body = r.json()
        if not isinstance(body, dict):
            raise MeshnetError(f"{path}: the tracker answered {type(body).__name__}, not an object")
        return body


def _error_message(r: httpx.Response) -> str:
    """The message of an API error body, else the body's text."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
