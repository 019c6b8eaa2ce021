"""A small client for a running mesh's chat API (used by ``meshnet chat`` and ``up --once``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from meshnet.errors import MeshnetError


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
