"""Several choices of one prompt (``n``): each a generation of its own, run together.

Choice ``i`` samples with seed ``(seed + i) mod 2^63``, where ``seed`` is the
request's (a fresh random one when it names none), so choice ``i`` is exactly
the solo run of the same request with ``n: 1`` and that seed: choice 0 is the
request's own solo run. The prompt is computed once: choice 0 opens first, and
its prefill fills the route's prefix caches (kv/prefix_cache.py) as it commits;
the others open once its first token has come, routed by prefix to those nodes,
and start from the cached blocks (only the prompt's last partial block is
computed again): they share its prefix-cache scope, the request's. Where the
caches are off, each choice computes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshnet.api.caller import Meter
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.accounting import billing
from meshnet.tracker.nodes.routes import Route
from meshnet.tracker.routing.driver import DoneEvent, TokenEvent
from meshnet.tracker.service import Started, Tracker

Event = TokenEvent | DoneEvent
SEED_SPACE = 2**63


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of each of ``n`` choices: one seed each, the request's plus the index."""
    if n == 1:
        return [params]
    seed = params.seeded().seed
    assert seed is not None  # seeded() fixed one
    return [replace(params, seed=(seed + i) % SEED_SPACE) for i in range(n)]


@dataclass(frozen=True)
class Choice:
    """One choice whose route is open and whose first event (the prefill's) has come."""

    index: int
    started: Started
    first: Event
    events: AsyncGenerator[Event, None]  # the rest, metered


async def open_choices(
    tracker: Tracker,
    prompt_ids: Sequence[int],
    params: Sequence[SamplingParams],
    top_logprobs: int,
    named: Route | None,
    meters: Sequence[Meter],
    tenant: str,
    scope: bytes,
) -> list[Choice]:
    """Start one generation per ``params`` (charged to its meter, billed to ``tenant``),
    up to each one's first event: the first alone, then the others together (on its
    cached prefill, in the prefix-cache ``scope``: ``Tracker.prefix_scope``); when any
    fails, every other is closed and the first failure raised."""

    async def one(index: int) -> Choice:
        try:
            started = await tracker.start(
                prompt_ids, params[index], top_logprobs, named, scope=scope
            )
        except BaseException:
            meters[index].end()
            raise
        events = _metered(started.events, meters[index])
        try:
            first = await anext(events)
            billing.attribute(tracker.store.db, started.generation_id, tenant)
        except BaseException:
            await events.aclose()
            raise
        return Choice(index, started, first, events)

    first = await one(0)  # its prefill, cached on its route, is the others' too
    rest = await asyncio.gather(*(one(i) for i in range(1, len(params))), return_exceptions=True)
    opened = [first, *(r for r in rest if isinstance(r, Choice))]
    failed = [r for r in rest if isinstance(r, BaseException)]
    if failed:
        for choice in opened:
            await choice.events.aclose()
        raise failed[0]
    return opened


async def finish_all(choices: Sequence[Choice]) -> list[DoneEvent | None]:
    """Each choice run to its end, together: its last event (None: it ended without one)."""

    async def rest(choice: Choice) -> DoneEvent | None:
        done = choice.first if isinstance(choice.first, DoneEvent) else None
        async for event in choice.events:
            if isinstance(event, DoneEvent):
                done = event
        return done

    tasks = [asyncio.ensure_future(rest(c)) for c in choices]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _stop(tasks, choices)


async def merged(choices: Sequence[Choice]) -> AsyncGenerator[tuple[int, Event], None]:
    """Every choice's events as they come, each with its choice's index; each choice's
    in order. A choice's failure ends the whole stream with it."""
    for choice in choices:
        yield choice.index, choice.first
    live = [c for c in choices if not isinstance(c.first, DoneEvent)]
    if len(live) == 1:  # one choice (the usual): its events as they are, no task between
        try:
            async for event in live[0].events:
                yield live[0].index, event
        finally:
            await _stop([], choices)
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue(
        maxsize=4 * max(len(live), 1)
    )

    async def pump(choice: Choice) -> None:
        try:
            async for event in choice.events:
                await queue.put((choice.index, event))
        except Exception as e:  # raised to the reader, in the stream's order
            await queue.put((choice.index, e))
            return
        await queue.put((choice.index, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in live]
    try:
        running = len(live)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        await _stop(tasks, choices)


async def _stop(tasks: Sequence[asyncio.Future[Any]], choices: Sequence[Choice]) -> None:
    """Cancel what still runs, wait for it, and close every choice's generation."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for choice in choices:
        with contextlib.suppress(Exception):
            await choice.events.aclose()


async def _metered(events: AsyncGenerator[Event, None], slot: Meter) -> AsyncGenerator[Event, None]:
    """The generation's events; its tokens are charged to the tenant and its stream freed
    when it ends."""
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                slot.charge(1)
            yield event
    finally:
        slot.end()
        await events.aclose()
