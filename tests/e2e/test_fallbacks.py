"""Fallbacks that had code and no test, each on real processes (tiny model).

- a failover whose failed span's inputs are gone (the hop before it died too) restarts
  from token zero, and the stream is still exact;
- ``--max-recoveries`` ends a generation with its failure's typed error once spent;
- an explicit cancel moves the tracker's cancelled-outcome counter;
- a duplicate of a step still running is refused, and the step itself completes;
- a second configure while one runs is refused, and a T3 the node does not drain for
  within ``--drain-timeout`` is withdrawn: the node serves what it served.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from conftest import MeshFactory, SoloIds
from faults import address, info, signed
from prometheus_client.parser import text_string_to_metric_families
from streams import Streamed, at, serving, stream_completion
from tiny_requests import long_completion

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.gguf_file import sha256_file
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

BODY = long_completion(seed=3)


@pytest.fixture(scope="module")
def model(tiny_factory: Any) -> Path:
    return Path(tiny_factory("long.gguf", context_length=4096))


@pytest.fixture(scope="module")
def expected(model: Path, solo_ids: SoloIds) -> list[int]:
    ids = solo_ids(model, BODY)
    assert len(ids) == BODY["max_tokens"]
    return ids


def test_a_failover_without_the_failed_spans_inputs_restarts_from_token_zero(
    mesh_factory: MeshFactory, model: Path, expected: list[int]
) -> None:
    """Both hops of the route die at once: the span after the first has no surviving
    hop to give its inputs back, so the whole route is rebuilt from the token ids."""
    mesh = mesh_factory("0:2,0:2,2:4,2:4", model=model)

    def kill_route(s: Streamed) -> None:
        for layers in ((0, 2), (2, 4)):
            mesh.kill_node(serving(s, layers), signal.SIGKILL)

    s = stream_completion(mesh, BODY, at(10, kill_route))
    assert s.error is None, s.error
    assert s.ids == expected
    assert s.final is not None
    methods = [r["method"] for r in s.final["recoveries"]]
    assert "restart" in methods, s.final["recoveries"]


def test_max_recoveries_ends_the_generation_with_its_typed_error(
    mesh_factory: MeshFactory, model: Path
) -> None:
    """A replica could take over, but the cap is 0: the failure is the answer."""
    mesh = mesh_factory("0:2,2:4,2:4", model=model, tracker_args=["--max-recoveries", "0"])
    s = stream_completion(mesh, BODY, at(10, lambda s: mesh.kill_node(serving(s, (2, 4)))))
    assert s.final is None
    assert s.error is not None and s.error["code"] == "worker-death", s.error
    assert len(s.ids) < BODY["max_tokens"]


def _finished(mesh: LocalMesh, outcome: str) -> float:
    """Generations the tracker counts as ended with ``outcome``, of every kind."""
    r = httpx.get(f"{mesh.url}/metrics", headers=mesh.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    return sum(
        s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name == "meshnet_generations_finished_total" and s.labels["outcome"] == outcome
    )


def test_a_cancel_moves_the_cancelled_outcome_counter(
    mesh_factory: MeshFactory, model: Path
) -> None:
    mesh = mesh_factory("0:2,2:4", model=model)
    before = _finished(mesh, "cancelled")

    def cancel(s: Streamed) -> None:
        url = f"{mesh.url}/admin/generations/{s.generation_id}/cancel"
        httpx.post(url, headers=mesh.admin_headers, timeout=30).raise_for_status()

    s = stream_completion(mesh, {**BODY, "max_tokens": 2000}, at(5, cancel))  # long: still on
    assert s.error is not None and s.error["code"] == "cancelled"
    assert _finished(mesh, "cancelled") == before + 1
    assert _finished(mesh, "completed") == 0


# --- a node driven by hand: steps and configures ------------------------------------

ROWS = 3000  # a prompt of hidden rows, one row a forward: it runs for a while


@pytest.fixture(scope="module")
def slow_prompts(mesh_factory: MeshFactory, model: Path) -> LocalMesh:
    """node-1 [2,4) runs prompts one row a forward (a prompt of ``ROWS`` takes seconds)
    and gives a staged change 0.5 s to drain."""
    mesh = mesh_factory("0:2", model=model, need_route=False)
    extra = ["--prefill-chunk", "1", "--drain-timeout", "0.5"]
    mesh.start_node("node-1", LayerRange(2, 4), extra=extra)
    mesh.wait_ready(expected_nodes=2, timeout_s=120)
    return mesh


class HeldStream:
    """A Forward stream on node-1 opened as the tracker would, its steps sent by hand."""

    def __init__(self, mesh: LocalMesh, model: Path, session_id: str) -> None:
        self._requests: list[pb.ForwardRequest | None] = []
        self._cv = threading.Condition()
        opened = pb.Open(
            session_id=session_id,
            epoch=1,
            fingerprint=sha256_file(model),
            layer_start=2,
            layer_end=4,
            keep=True,  # the session outlives either stream
        )
        self.send(pb.ForwardRequest(open=opened))
        self._channel = grpc.insecure_channel(address(mesh, "node-1"))
        stub = pb_grpc.NodeStub(self._channel)
        md = signed(mesh, "node-1", "Forward")
        self._answers = iter(stub.Forward(self._iterate(), metadata=md, timeout=120))
        first = self.answer()
        assert first.WhichOneof("kind") == "opened", first

    def send(self, request: pb.ForwardRequest | None) -> None:
        with self._cv:
            self._requests.append(request)
            self._cv.notify()

    def step(self, rows: int) -> None:
        x = codec.encode(np.zeros((rows, 64), np.float32))
        self.send(pb.ForwardRequest(step=pb.Step(step=0, input=x)))

    def answer(self) -> pb.ForwardResponse:
        return next(self._answers)

    def close(self) -> None:
        self.send(None)
        self._channel.close()

    def _iterate(self) -> Iterator[pb.ForwardRequest]:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._requests))
                request = self._requests.pop(0)
            if request is None:
                return
            yield request


def _running_prompt(mesh: LocalMesh, model: Path, sid: str) -> HeldStream:
    """A stream whose long prompt step has begun running on node-1."""
    stream = HeldStream(mesh, model, sid)
    opened = info(mesh, "node-1").kv_bytes
    stream.step(ROWS)
    deadline = time.monotonic() + 60
    # Tens of rows in its KV (a row is 256 or 512 bytes here): it is half-run, not
    # merely admitted with the room of its first rows.
    while info(mesh, "node-1").kv_bytes < opened + (16 << 10):
        assert time.monotonic() < deadline, "the prompt never ran"
        time.sleep(0.01)
    return stream


def test_a_duplicate_of_a_step_still_running_is_refused(
    slow_prompts: LocalMesh, model: Path
) -> None:
    first = _running_prompt(slow_prompts, model, "dup")
    second = HeldStream(slow_prompts, model, "dup")  # the same session and epoch
    try:
        second.step(ROWS)  # step 0 again, while the first runs
        refused = second.answer()
        assert refused.failure.kind == "malformed-bundle", refused
        assert "already running" in refused.failure.message
        done = first.answer()  # the running step is untouched
        assert not done.HasField("failure"), done
    finally:
        first.close()
        second.close()


def _configure(
    mesh: LocalMesh, request: pb.ConfigureRequest, channel: grpc.Channel | None = None
) -> pb.ConfigureResponse:
    if channel is None:
        with grpc.insecure_channel(address(mesh, "node-1")) as own:
            return _configure(mesh, request, own)
    md = signed(mesh, "node-1", "Configure")
    return pb_grpc.NodeStub(channel).Configure(request, metadata=md, timeout=120)


def test_a_t3_not_drained_in_time_is_withdrawn_and_a_second_configure_refused(
    slow_prompts: LocalMesh, model: Path
) -> None:
    # Prompts run side by side, a row each a forward: together they outlast loading the
    # new shard and the drain's wait by far, even on a busy machine.
    streams = [_running_prompt(slow_prompts, model, f"drain-{i}") for i in range(4)]
    stream = streams[0]
    load = pb.ConfigureRequest(load=pb.LoadShard(model_path=str(model), layer_start=0, layer_end=4))
    answers: list[pb.ConfigureResponse] = []

    def send_t3() -> None:
        while True:  # again while one of the test's T1s holds the node's configure
            answer = _configure(slow_prompts, load)
            if "another configure" not in answer.failure.message:
                answers.append(answer)
                return

    t3 = threading.Thread(target=send_t3)
    channel = grpc.insecure_channel(address(slow_prompts, "node-1"))
    try:
        t3.start()
        second = pb.ConfigureRequest(limits=pb.Limits(log_level="info"))
        while True:  # until the T3 holds the node's configure (or is over)
            refused = _configure(slow_prompts, second, channel)
            if refused.failure.kind or not t3.is_alive():
                break
            time.sleep(0.01)
        assert refused.failure.kind == "overloaded", (refused, answers)
        assert "another configure is running" in refused.failure.message
        t3.join(120)
        (withdrawn,) = answers
        assert not withdrawn.applied
        assert withdrawn.failure.kind == "overloaded", withdrawn
        assert "did not drain" in withdrawn.failure.message
        assert (withdrawn.layer_start, withdrawn.layer_end) == (2, 4)  # nothing changed
        done = stream.answer()
        assert not done.HasField("failure"), done
    finally:
        for each in streams:
            each.close()
        channel.close()
        t3.join(120)
    now = info(slow_prompts, "node-1")
    assert (now.layer_start, now.layer_end) == (2, 4)
