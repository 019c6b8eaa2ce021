"""Read byte ranges of a remote file over HTTP, with bounded retries and backoff.

Requests go through ``huggingface_hub``'s HTTP session (its proxies, timeouts and
headers); a range is asked for with ``Range: bytes=A-B`` and must come back as
such (206 and the same ``Content-Range`` start). A dropped connection, a short
body, a 429 or a 5xx is tried again after a wait that doubles (full jitter), from
the byte where it stopped, ``cfg.attempts`` times in all; then ``FetchFailed``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshnet.errors import FetchFailed, ModelRefNotFound
from meshnet.model_source.config import SourceConfig

if TYPE_CHECKING:  # imported where a range is read: a node that fetches nothing never loads them
    import httpx2

Sink = Callable[[int, bytes], None]  # (offset in the file, bytes read there)
_READ = 1 << 16


class _Transient(Exception):
    """A failure that another try may not have."""


def read_range(url: str, start: int, end: int, headers: dict[str, str], cfg: SourceConfig) -> bytes:
    """The bytes ``[start, end)`` of the file at ``url``."""
    out = bytearray(end - start)

    def sink(offset: int, data: bytes) -> None:
        out[offset - start : offset - start + len(data)] = data

    stream_range(url, start, end, headers, cfg, sink)
    return bytes(out)


def stream_range(
    url: str, start: int, end: int, headers: dict[str, str], cfg: SourceConfig, sink: Sink
) -> None:
    """Hand ``sink`` the bytes ``[start, end)`` of ``url`` in order, as they arrive;
    tried again from where it stopped on a transient failure (see the module)."""
    pos, failures = start, 0
    while pos < end:
        try:
            pos = _one_request(url, pos, end, headers, cfg, sink)
        except _Transient as e:
            failures += 1
            if failures >= cfg.attempts:
                raise FetchFailed(f"{url}: bytes {pos}-{end}: {e} ({failures} tries)") from None
            time.sleep(backoff(cfg, failures))


def backoff(cfg: SourceConfig, failures: int) -> float:
    """The wait after the ``failures``-th failure: full jitter under a doubling cap."""
    return random.uniform(0, min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (failures - 1)))


def _one_request(
    url: str, pos: int, end: int, headers: dict[str, str], cfg: SourceConfig, sink: Sink
) -> int:
    """One GET of ``[pos, end)``; the position reached (``end`` unless it failed midway)."""
    import httpx2
    from huggingface_hub.utils import get_session

    asked = {**headers, "Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
    try:
        with get_session().stream(
            "GET", url, headers=asked, follow_redirects=True, timeout=cfg.timeout_s
        ) as r:
            _check(r, url, pos)
            for data in r.iter_bytes(_READ):
                data = data[: end - pos]
                sink(pos, data)
                pos += len(data)
                if pos >= end:
                    break
    except httpx2.HTTPError as e:
        if pos < end:
            raise _Transient(f"{type(e).__name__}: {e}") from None
    if pos < end:
        raise _Transient("the body ended early")
    return pos


def _check(r: httpx2.Response, url: str, pos: int) -> None:
    if r.status_code == 404:
        raise ModelRefNotFound(f"{url}: no such file (404)")
    if r.status_code == 429 or r.status_code >= 500:
        raise _Transient(f"HTTP {r.status_code}")
    if r.status_code != 206:
        raise FetchFailed(f"{url}: a range request was answered {r.status_code}, not 206")
    got = r.headers.get("Content-Range", "")
    if not got.startswith(f"bytes {pos}-"):
        raise FetchFailed(f"{url}: asked for bytes from {pos}, got {got!r}")
