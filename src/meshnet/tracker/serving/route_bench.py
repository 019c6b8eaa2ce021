"""Route benchmarks: the same greedy generation on each named route in turn, timed by the
tracker, checked against the output of the route the planner picks, and recorded.

A run first generates once unpinned (the reference: the tokens every route
must give, since greedy tokens do not depend on the split), then runs every
route ``rounds`` times, one generation at a time. Each generation goes through
``Tracker.start`` like a client's: it waits in admission for capacity and is
refused (``Overloaded``) like one. One run at a time per tracker: a second,
or one asked while another runs, is ``Overloaded`` at once, since routes timed
side by side would measure each other. Figures (``bench_store.RouteFigures``):

- ``ttft_ms``: from asking for the route (admission, open, prefill) to the
  first token, the median over rounds;
- ``token_ms_median`` / ``token_ms_p90``: the gaps between consecutive tokens,
  every round's pooled (nearest rank);
- ``tokens_per_s``: the tokens after each round's first, over the time from
  its first token to its last, summed over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshnet.engine.request import check_request
from meshnet.errors import MeshnetError, Overloaded, RequestError
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.nodes.registry import NodeId
from meshnet.tracker.nodes.routes import Route
from meshnet.tracker.routing.driver import DoneEvent, TokenEvent
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.bench_store import BenchStore, RouteFigures

MAX_ROUTES = 16  # routes in one run
MAX_ROUNDS = 20  # generations per route
MAX_TOKENS = 512  # generated per generation
MAX_PROMPT_TOKENS = 4096
MAX_RUN_TOKENS = 50_000  # (routes x rounds + 1) x max_tokens: the most one run generates
BUSY_RETRY_S = 10  # what a run refused while another runs is told to wait


@dataclass(frozen=True)
class BenchRequest:
    """One run: routes (node ids in order), a prompt, tokens per generation, rounds."""

    routes: tuple[tuple[NodeId, ...], ...]
    prompt_ids: tuple[int, ...]
    max_tokens: int
    rounds: int

    def __post_init__(self) -> None:
        checks = [
            (1 <= len(self.routes) <= MAX_ROUTES, f"1 to {MAX_ROUTES} routes"),
            (all(self.routes), "every route names at least one node"),
            (1 <= len(self.prompt_ids) <= MAX_PROMPT_TOKENS, f"1 to {MAX_PROMPT_TOKENS} tokens"),
            (1 <= self.max_tokens <= MAX_TOKENS, f"max_tokens from 1 to {MAX_TOKENS}"),
            (1 <= self.rounds <= MAX_ROUNDS, f"rounds from 1 to {MAX_ROUNDS}"),
            (self.work <= MAX_RUN_TOKENS, f"at most {MAX_RUN_TOKENS} tokens generated in a run"),
        ]
        for ok, bound in checks:
            if not ok:
                raise RequestError(f"route benchmark out of bounds: {bound}")

    @property
    def work(self) -> int:
        """Tokens the run generates at most: every round of every route, and the reference."""
        return (len(self.routes) * self.rounds + 1) * self.max_tokens

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0)


@dataclass(frozen=True)
class Round:
    """One timed generation: its tokens, the route that served it, when tokens came."""

    ids: tuple[int, ...]
    route: Route
    ttft_s: float
    token_times: tuple[float, ...] = field(default=())  # monotonic, one per token

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


@dataclass(frozen=True)
class BenchRun:
    run_id: str
    reference: Round  # the unpinned generation every route is compared with
    figures: tuple[RouteFigures, ...]


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) by nearest rank: a value that occurred."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class RunInfo:
    """What every route of one run shares."""

    run_id: str
    model: str
    fingerprint: str
    prompt_tokens: int
    max_tokens: int


def summarise(
    info: RunInfo, position: int, rounds: Sequence[Round], reference: Sequence[int], now: float
) -> RouteFigures:
    """The figures of the route at ``position`` from its rounds (at least one)."""
    gaps = [g for r in rounds for g in r.gaps_s]
    decode_tokens = sum(len(r.token_times) - 1 for r in rounds if r.token_times)
    decode_s = sum(r.token_times[-1] - r.token_times[0] for r in rounds if r.token_times)
    return RouteFigures(
        run_id=info.run_id,
        position=position,
        recorded=now,
        model=info.model,
        fingerprint=info.fingerprint,
        hops=tuple((h.node_id, h.layers) for h in rounds[0].route),
        prompt_tokens=info.prompt_tokens,
        max_tokens=info.max_tokens,
        rounds=len(rounds),
        tokens=len(rounds[0].ids),
        ttft_ms=statistics.median(r.ttft_s for r in rounds) * 1000,
        token_ms_median=statistics.median(gaps) * 1000 if gaps else None,
        token_ms_p90=nearest_rank(gaps, 0.9) * 1000 if gaps else None,
        tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else None,
        output_equal=all(list(r.ids) == list(reference) for r in rounds),
    )


class RouteBench:
    """Runs route benchmarks on a tracker, one at a time, and records each run whole.
    Call from the tracker's event loop only."""

    def __init__(self, tracker: Tracker, store: BenchStore) -> None:
        self.tracker = tracker
        self.store = store
        self._running = asyncio.Lock()

    async def run(self, request: BenchRequest) -> BenchRun:
        """Run and record ``request``; ``RequestError`` (400) for a bad route or prompt,
        before anything runs; ``Overloaded`` while another run goes on or when capacity
        stays short; ``NoRoute`` when a named node fails. A failed run records nothing."""
        if self._running.locked():
            raise Overloaded("a route benchmark is already running", retry_after_s=BUSY_RETRY_S)
        async with self._running:
            for node_ids in request.routes:
                self.tracker.planner.requested_route(node_ids)
            params = request.params
            limit = self.tracker.planner.context_limit()
            check_request(self.tracker.model.spec, request.prompt_ids, params, limit)
            model = self.tracker.model
            info = RunInfo(
                uuid.uuid4().hex,
                model.name,
                model.fingerprint,
                len(request.prompt_ids),
                request.max_tokens,
            )
            reference = await self._round(request, None)
            figures = []
            for position, node_ids in enumerate(request.routes):
                route = self.tracker.planner.requested_route(
                    node_ids
                )  # as it is now, not at the start
                rounds = [await self._round(request, route) for _ in range(request.rounds)]
                figures.append(summarise(info, position, rounds, reference.ids, time.time()))
            self.store.record(figures)
            return BenchRun(info.run_id, reference, tuple(figures))

    async def _round(self, request: BenchRequest, named: Route | None) -> Round:
        begun = time.monotonic()
        started = await self.tracker.start(request.prompt_ids, request.params, -1, named)
        times: list[float] = []
        done: DoneEvent | None = None
        async with contextlib.aclosing(started.events) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    times.append(time.monotonic())
                else:
                    done = event
        if done is None or not times:
            raise MeshnetError("a benchmark generation ended without a result")
        return Round(tuple(done.ids), done.route or started.route, times[0] - begun, tuple(times))
