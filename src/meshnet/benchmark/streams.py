"""Streamed completions as a client sees them, and the decode rates they show.

One client for both sides of a serving benchmark: it posts an OpenAI
``/v1/completions`` request with ``stream: true`` and notes when each token's
chunk arrives. The token count is the server's own ``usage.completion_tokens``
(asked for with ``stream_options.include_usage``), so a chunk that carried two
tokens still counts two; the arrival times of the first and the last token
chunks bound the decode. The rates are pure functions of those records, the
same for every server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from meshnet.errors import MeshnetError


@dataclass(frozen=True)
class StreamRecord:
    """One streamed completion: when it was sent and when its token chunks arrived."""

    sent: float  # time.perf_counter() when the request went out
    arrivals: tuple[float, ...]  # each token chunk's arrival, in order
    tokens: int  # completion tokens the server says it generated
    finish_reason: str | None


def decode_tok_s(record: StreamRecord) -> float:
    """Tokens per second after the first (the first carries the prefill)."""
    if record.tokens < 2 or len(record.arrivals) < 2:
        raise MeshnetError(f"a stream of {record.tokens} tokens has no decode to time")
    return (record.tokens - 1) / (record.arrivals[-1] - record.arrivals[0])


def steady_tok_s(records: Sequence[StreamRecord]) -> float:
    """Aggregate decode tok/s of concurrent streams while all of them were decoding.

    The window opens when the last stream got its first token and closes when the
    first stream got its last; every token chunk that arrived inside it, from any
    stream, counts. Prefill and the ragged ends are left out, so the figure is the
    server's steady batched decode rate.
    """
    start = max(r.arrivals[0] for r in records)
    end = min(r.arrivals[-1] for r in records)
    if end <= start:
        raise MeshnetError("the streams never all decoded at once: no steady window")
    inside = sum(1 for r in records for t in r.arrivals if start < t <= end)
    return inside / (end - start)


def end_to_end_tok_s(records: Sequence[StreamRecord]) -> float:
    """All completion tokens over the time from the first request sent to the last
    token received: what a client holding all the streams sees, prefill included."""
    first = min(r.sent for r in records)
    last = max(r.arrivals[-1] for r in records)
    return sum(r.tokens for r in records) / (last - first)


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion of exactly ``max_tokens``: both servers (meshnet,
    llama-server) honour ``ignore_eos``."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> StreamRecord:
    """Post one streamed completion to ``url`` and record its chunks' arrivals.

    Raises ``MeshnetError`` on a non-200 answer (a 429 included: a benchmark
    that was refused has measured nothing) or an error inside the stream.
    """
    arrivals: list[float] = []
    tokens: int | None = None
    finish: str | None = None
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:500]
            raise MeshnetError(f"{url} answered {r.status_code}: {text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise MeshnetError(f"{url} failed mid-stream: {chunk['error']}")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                if _is_token(chunk, choice):
                    arrivals.append(now)
    if tokens is None:
        raise MeshnetError(f"{url} streamed no usage (stream_options.include_usage)")
    return StreamRecord(sent, tuple(arrivals), tokens, finish)


def _is_token(chunk: dict[str, Any], choice: dict[str, Any]) -> bool:
    """A chunk that carries generated text: meshnet names its token ids (its opening
    chunk has none), other servers send text only with tokens."""
    if choice.get("finish_reason") is not None:
        return False
    meta = chunk.get("meshnet")
    if isinstance(meta, dict):
        return bool(meta.get("ids"))
    return bool(choice.get("text"))


async def _concurrent(
    url: str, bodies: Sequence[dict[str, Any]], headers: Mapping[str, str] | None
) -> list[StreamRecord]:
    limits = httpx.Limits(max_connections=len(bodies) + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        return list(await asyncio.gather(*(stream_completion(client, url, b) for b in bodies)))


def run_streams(
    url: str, bodies: Sequence[dict[str, Any]], headers: Mapping[str, str] | None = None
) -> list[StreamRecord]:
    """All ``bodies`` streamed at once from ``url`` (sending ``headers``: a meshnet
    tracker wants its API key); one record each, in order."""
    return asyncio.run(_concurrent(url, bodies, headers))
