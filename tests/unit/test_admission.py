"""Admission reserves capacity before a route opens: a tracker slot and a stream per
node, a bounded wait for room, and ``Overloaded`` (with its Retry-After) past that."""

from __future__ import annotations

import asyncio

import pytest

from meshnet.errors import Overloaded
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeLoad
from meshnet.tracker.nodes.admission import Admission, AdmissionConfig, Reservation
from meshnet.tracker.nodes.registry import NodeRecord, NodeState


def node(node_id: str, max_streams: int = 0) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        address="127.0.0.1:1",
        fingerprint="f" * 64,
        layers=LayerRange(0, 2),
        backend="numpy",
        kv_budget_bytes=0,
        pid=1,
        state=NodeState.UP,
        last_seen=0.0,
        load=NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0, max_streams=max_streams),
    )


def test_a_reservation_holds_a_slot_and_each_nodes_stream_until_released() -> None:
    a = Admission(AdmissionConfig(max_in_flight=2, node_streams=1))
    held = a.reserve(["n1", "n2"])
    assert a.in_flight == 1 and a.full_nodes([node("n1"), node("n2"), node("n3")]) == {"n1", "n2"}
    held.release()
    held.release()  # a second release gives nothing back twice
    assert a.in_flight == 0 and a.full_nodes([node("n1"), node("n2")]) == frozenset()


def test_a_node_says_how_many_streams_it_holds() -> None:
    a = Admission(AdmissionConfig(node_streams=1))
    a.reserve(["big"])
    a.reserve(["big"])
    assert a.full_nodes([node("big", max_streams=3)]) == frozenset()
    a.reserve(["big"])
    assert a.full_nodes([node("big", max_streams=3)]) == {"big"}


def test_past_max_in_flight_is_overloaded_with_a_retry_after() -> None:
    a = Admission(AdmissionConfig(max_in_flight=1, queue_wait_s=2.5))
    a.reserve(["n1"])
    with pytest.raises(Overloaded) as refused:
        a.reserve(["n2"])
    assert refused.value.retry_after_s == 3
    assert a.in_flight == 1  # the refusal took nothing


def test_a_waiting_request_gets_the_first_freed_slot() -> None:
    async def scenario() -> tuple[Reservation, float]:
        a = Admission(AdmissionConfig(max_in_flight=1, queue_wait_s=5.0))
        first = a.reserve(["n1"])
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, first.release)
        t0 = loop.time()
        second = await a.acquire(lambda: a.reserve(["n1"]))
        return second, loop.time() - t0

    second, waited = asyncio.run(scenario())
    assert not second.released and 0.04 <= waited < 2.0


def test_the_wait_is_bounded_in_time_and_in_length() -> None:
    async def scenario() -> tuple[BaseException | None, BaseException | None, int]:
        a = Admission(AdmissionConfig(max_in_flight=1, max_queued=1, queue_wait_s=0.1))
        a.reserve(["n1"])
        waiting = asyncio.create_task(a.acquire(lambda: a.reserve(["n1"])))
        await asyncio.sleep(0.01)
        try:  # the queue holds one: the next is refused at once
            await a.acquire(lambda: a.reserve(["n1"]))
            at_once = None
        except Overloaded as e:
            at_once = e
        try:
            await waiting
            timed_out = None
        except Overloaded as e:
            timed_out = e
        return at_once, timed_out, a.in_flight

    at_once, timed_out, in_flight = asyncio.run(scenario())
    assert isinstance(at_once, Overloaded) and isinstance(timed_out, Overloaded)
    assert in_flight == 1
