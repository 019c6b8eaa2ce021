"""Per-tenant rate and concurrency limits, enforced by this tracker process.

Requests and tokens are counted over the last minute (a sliding window);
streams are the tenant's generations and turns in flight. A request over any
limit is refused with ``QuotaExceeded`` (429) and a ``Retry-After`` of when
the window has room again. Sessions and KV bytes are counted from the
database by the caller (``check_sessions``, ``check_kv``). Trackers sharing a
database each enforce the rate limits on their own traffic.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnet.api.tenants import Tenant
from meshnet.errors import QuotaExceeded

WINDOW_S = 60.0


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    streams: int = 0

    def expire(self, now: float) -> None:
        while self.requests and now - self.requests[0] >= WINDOW_S:
            self.requests.popleft()
        while self.tokens and now - self.tokens[0][0] >= WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


def _after(stamp: float, now: float) -> int:
    return max(1, math.ceil(stamp + WINDOW_S - now))


class QuotaGate:
    """Counts each tenant's use; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant, prompt_tokens: int = 0, stream: bool = True) -> Slot:
        """Count one request (and its prompt's tokens); hold a stream until the slot ends."""
        q = tenant.quotas
        now = self._clock()
        with self._lock:
            use = self._usage.setdefault(tenant.id, _Usage())
            use.expire(now)
            if q.requests_per_min and len(use.requests) >= q.requests_per_min:
                retry = _after(use.requests[0], now)
                raise QuotaExceeded(
                    f"tenant {tenant.id} is over {q.requests_per_min} requests a minute",
                    retry_after_s=retry,
                )
            if q.tokens_per_min and use.token_sum + prompt_tokens > q.tokens_per_min:
                retry = _after(use.tokens[0][0], now) if use.tokens else int(WINDOW_S)
                raise QuotaExceeded(
                    f"tenant {tenant.id} is over {q.tokens_per_min} tokens a minute",
                    retry_after_s=retry,
                )
            if stream and q.max_streams and use.streams >= q.max_streams:
                raise QuotaExceeded(
                    f"tenant {tenant.id} has its {q.max_streams} streams running", retry_after_s=1
                )
            if q.requests_per_min:
                use.requests.append(now)
            if q.tokens_per_min:
                self._charge(use, now, prompt_tokens)
            if stream:
                use.streams += 1
        return Slot(self, tenant, stream)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Count tokens generated for the tenant (kept only where a limit counts them)."""
        if not tenant.quotas.tokens_per_min:
            return
        with self._lock:
            use = self._usage.setdefault(tenant.id, _Usage())
            self._charge(use, self._clock(), tokens)

    def streams(self, tenant_id: str) -> int:
        with self._lock:
            use = self._usage.get(tenant_id)
            return use.streams if use else 0

    @staticmethod
    def _charge(use: _Usage, now: float, tokens: int) -> None:
        if tokens > 0:
            use.tokens.append((now, tokens))
            use.token_sum += tokens

    def _end(self, tenant_id: str) -> None:
        with self._lock:
            self._usage[tenant_id].streams -= 1


class Slot:
    """A request admitted under its tenant's quotas; ``end()`` frees its stream (once)."""

    def __init__(self, gate: QuotaGate, tenant: Tenant, stream: bool) -> None:
        self._gate = gate
        self.tenant = tenant
        self._open = stream

    def charge(self, tokens: int) -> None:
        self._gate.charge(self.tenant, tokens)

    def end(self) -> None:
        if self._open:
            self._open = False
            self._gate._end(self.tenant.id)


def check_sessions(tenant: Tenant, open_sessions: int) -> None:
    limit = tenant.quotas.max_sessions
    if limit and open_sessions >= limit:
        raise QuotaExceeded(f"tenant {tenant.id} holds its {limit} sessions", retry_after_s=60)


def check_kv(tenant: Tenant, kv_bytes: int) -> None:
    limit = tenant.quotas.max_kv_bytes
    if limit and kv_bytes >= limit:
        raise QuotaExceeded(
            f"tenant {tenant.id}'s sessions hold {kv_bytes} bytes of KV, its limit is {limit}",
            retry_after_s=60,
        )
