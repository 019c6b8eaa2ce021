"""Calibration before routing, and the node states verification adds.

With verification on, a node that registers with a layer range, or comes to
serve another one (a T3 configure, placement, a heal), is ``calibrating``:
the tracker computes a fresh random input at the range's start boundary and
the rows at its end on trusted capacity (verifier.TrustedModel), sends the
input as an ordinary one-off step (a throwaway session id, released when the
stream ends), and compares the node's commitments and its output exactly;
then a second fresh input of the same shape (a node that answers from a cache
of earlier inputs fails it). A node on a backend that is not bit-exact
(``numpy``) is compared within tolerances instead: its sketches as the verifier
compares them (protocol/sketches.py), its output within ``OUTPUT_RTOL``. A
match makes the node ``up`` (routable); a mismatch, or an error answered to
an input, ``quarantined``, with the reason. A node that cannot be reached (or
is busy) is left ``calibrating`` and tried again at a heartbeat, backing off:
each try costs the tracker a trusted computation.

A quarantined node stays out (its registrations and heartbeats keep it
quarantined) until it serves another range or model, which is calibrated
afresh. A tracker that restarts keeps a quarantined node so until then too.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshnet.errors import (
    Cancelled,
    KVBudgetExhausted,
    MalformedBundle,
    MeshnetError,
    NodeFailure,
    Overloaded,
)
from meshnet.layer_range import LayerRange
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import CHUNK_TOKENS, EXACT_BACKENDS, chunk_digests_of
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.commitments import checked_chunks
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.routes import Hop
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.trust.throwaway import run_steps
from meshnet.tracker.trust.verifier import TrustedModel, compare_chunk

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 2 * CHUNK_TOKENS  # positions of a calibration input
# Inputs of one calibration, each fresh and of the same shape: a node that answers a new
# input with what it cached for an earlier one fails the second.
CALIBRATION_INPUTS = 2
_TIMEOUT_S = 60.0
# Failures that say nothing of a node's honesty (not reached, busy): its calibration is
# tried again, first after _RETRY_S and then twice as long each time, up to _RETRY_MAX_S.
# Any other error answered to a calibration input is a failed calibration.
_NOT_A_VERDICT = (NodeFailure, Overloaded, KVBudgetExhausted, Cancelled)
_RETRY_S = 1.0
_RETRY_MAX_S = 60.0
# A node whose backend is not bit-exact: each output element within OUTPUT_RTOL x its
# row's largest |value| of the verifier's. Honest numpy rows and logits differ by
# <= 8.8e-6 of that (docs/verification.md); its commitments are what catch a cheat.
OUTPUT_RTOL = 1e-4

Served = tuple[str, LayerRange]  # (fingerprint, layers): what a verdict is about


@dataclass(frozen=True)
class Calibration:
    """A calibration input and what an honest node answers to it."""

    tokens: np.ndarray  # ids [T]
    x: np.ndarray  # the input at the range's start: the ids, or hidden rows [T, d]
    rows: np.ndarray  # the rows at the range's end [T, d]
    output: np.ndarray  # what the node answers: ``rows``, or on the last range the logits


def prepare(model: TrustedModel, layers: LayerRange, seed: int) -> Calibration:
    """A fresh random input for ``layers`` and its expected answer (trusted compute)."""
    spec = model.spec
    tokens = np.random.default_rng(seed).integers(0, spec.vocab_size, CALIBRATION_TOKENS)
    x = tokens if layers.start == 0 else model.boundary_rows(tokens, layers.start)
    rows = model.boundary_rows(tokens, layers.end)
    last = layers.end == spec.n_layers
    output = model.logits_of(rows[-1])[None, :] if last else rows
    return Calibration(tokens, x, rows, output)


def compare(cal: Calibration, result: pb.StepResult, exact: bool = True) -> str:
    """Why the node's answer is not the trusted one; "" when it is, bit for bit, or for
    a node that is not on an exact backend (``exact`` False) within the tolerances."""
    try:
        got = checked_chunks(result.commitments)
        rows, width = cal.output.shape
        out = codec.decode(result.output, codec.TensorLimits("f32", 2, rows, width))
    except MalformedBundle as e:
        return f"calibration: a malformed answer: {e.message}"
    want = chunk_digests_of(cal.rows, 0)
    if sorted(got) != sorted(want):
        return f"calibration: commitments differ ({len(got)} chunks sent, {len(want)} expected)"
    for start, commitment in sorted(got.items()):
        why = compare_chunk(commitment, cal.rows[start : start + CHUNK_TOKENS], exact)
        if why:
            return f"calibration: commitments differ at position {start}: {why}"
    if out.shape != cal.output.shape or not _close(out, cal.output, exact):
        return "calibration: the output differs from the verifier's"
    return ""


def _close(out: np.ndarray, want: np.ndarray, exact: bool) -> bool:
    """``out`` equals ``want`` bit for bit, or when not ``exact`` within ``OUTPUT_RTOL``."""
    if exact:
        return bool(np.array_equal(out, want))
    with np.errstate(all="ignore"):
        scale = np.abs(want).max(axis=1, keepdims=True)
        return bool((np.abs(out - want) <= OUTPUT_RTOL * scale).all())  # NaN fails


async def run_calibration(
    channels: ChannelPool, node: NodeRecord, fingerprint: str, cal: Calibration
) -> str:
    """Send ``cal``'s input to ``node`` as one step of a throwaway session; "" when its
    answer is exact, else the reason. ``MeshnetError`` when the node was not reached."""
    assert node.layers is not None
    hop = Hop(node.node_id, node.address, node.layers)
    [result] = await run_steps(channels, fingerprint, hop, [cal.x], _TIMEOUT_S)
    return compare(cal, result, node.backend in EXACT_BACKENDS)


@dataclass
class _Verdict:
    served: Served
    passed: bool
    reason: str = ""


class NodeTrust:
    """Which nodes calibrated on what they serve; keeps the registry's states so.

    ``decide`` is called after each registration and heartbeat (from the event loop).
    ``on_quarantine(node_id, reason)`` fails over the node's running generations."""

    def __init__(
        self,
        store: Store,
        channels: ChannelPool,
        fingerprint: str,
        model: TrustedModel,
        on_quarantine: Callable[[str, str], None],
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.store = store
        self.channels = channels
        self.fingerprint = fingerprint
        self.model = model
        self.on_quarantine = on_quarantine
        self._verdicts: dict[str, _Verdict] = {}
        self._running: dict[str, tuple[Served, asyncio.Task[Any]]] = {}
        # Nodes not reached: node -> (what it serves, not to try before, the next delay).
        self._retry: dict[str, tuple[Served, float, float]] = {}
        self.calibrations = 0  # run to an answer, in all
        self.runs: Counter[str] = Counter()  # the same, per node
        self.trusted = trusted  # up without a calibration (tracker/trust/trusted_capacity.py)
        self.quarantines = 0

    def decide(self, node_id: str, before: NodeRecord | None = None) -> None:
        """Bring a node's state in line with its verdict on what it serves now: keep it,
        or start a calibration of what it has not calibrated on. ``before``: its record
        before a registration (which made it ``up``), as the registry had it."""
        node = self.store.node(node_id)
        if node is None or node.layers is None or node.state is NodeState.DOWN:
            return
        if node.fingerprint != self.fingerprint:
            return  # another model's node: never routed for this one
        served = (node.fingerprint, node.layers)
        if node_id in self.trusted:  # configuration, not a calibration, vouches for it
            self._verdicts[node_id] = _Verdict(served, True)
        verdict = self._verdicts.get(node_id)
        was = before if before is not None and before.state is NodeState.QUARANTINED else node
        if verdict is None and was.state is NodeState.QUARANTINED and was.layers is not None:
            old = (was.fingerprint, was.layers)  # a tracker restarted: its verdict, kept
            verdict = self._verdicts[node_id] = _Verdict(old, False, was.down_reason)
        if verdict is not None and verdict.served == served:
            state = NodeState.UP if verdict.passed else NodeState.QUARANTINED
            if node.state is not state:
                self.store.set_state(node_id, state, verdict.reason)
            return
        running = self._running.get(node_id)
        if running is not None and running[0] == served:
            return
        if running is not None:
            running[1].cancel()
        self.store.set_state(node_id, NodeState.CALIBRATING, "")
        if running is None and self._backing_off(node_id, served):
            return  # its last try did not reach it: not yet again
        task = asyncio.get_running_loop().create_task(self._calibrate(node, served))
        self._running[node_id] = (served, task)
        task.add_done_callback(lambda _: self._ran(node_id, task))

    def _backing_off(self, node_id: str, served: Served) -> bool:
        retry = self._retry.get(node_id)
        return retry is not None and retry[0] == served and time.monotonic() < retry[1]

    def _ran(self, node_id: str, task: asyncio.Task[Any]) -> None:
        running = self._running.get(node_id)
        if running is not None and running[1] is task:
            del self._running[node_id]

    async def calibrated(self, node_id: str, timeout_s: float = _TIMEOUT_S) -> bool:
        """Wait for a node's calibration (if one runs); True when it may be routed."""
        deadline = time.monotonic() + timeout_s
        while node_id in self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        verdict = self._verdicts.get(node_id)
        return verdict is not None and verdict.passed

    async def _calibrate(self, node: NodeRecord, served: Served) -> None:
        assert node.layers is not None
        reason = ""
        for _ in range(CALIBRATION_INPUTS):
            seed = int.from_bytes(uuid.uuid4().bytes[:8], "little")
            model = self.model.on(node.backend)  # exact against what it claims to run
            cal = await asyncio.to_thread(prepare, model, node.layers, seed)
            try:
                reason = await run_calibration(self.channels, node, self.fingerprint, cal)
            except _NOT_A_VERDICT as e:  # tried again at a later heartbeat
                retry = self._retry.get(node.node_id)
                delay = retry[2] if retry is not None and retry[0] == served else _RETRY_S
                again = time.monotonic() + delay
                self._retry[node.node_id] = (served, again, min(2 * delay, _RETRY_MAX_S))
                log.warning("node %s: calibration did not run (%.0f s): %s", node.node_id, delay, e)
                return
            except MeshnetError as e:  # reached: it refused or failed to compute the input
                reason = f"calibration: the node answered {e.kind}: {e.message}"
            if reason:
                break
        self._retry.pop(node.node_id, None)
        self.calibrations += 1
        self.runs[node.node_id] += 1
        if not reason:
            log.info("node %s calibrated on layers %s: up", node.node_id, node.layers)
            self._verdicts[node.node_id] = _Verdict(served, True)
            self.store.set_state(node.node_id, NodeState.UP, "")
            return
        self.quarantine(node.node_id, reason, served)

    def readmit(self, node_id: str) -> bool:
        """An operator's word that a quarantined node may be tried again: its verdict is
        forgotten and it calibrates afresh on what it serves, on new inputs (one that
        still computes something else is quarantined again). False when it is not
        quarantined, or not for this model."""
        node = self.store.node(node_id)
        if node is None or node.state is not NodeState.QUARANTINED:
            return False
        if node.layers is not None and node.fingerprint != self.fingerprint:
            return False
        log.warning("node %s readmitted by an operator: it calibrates again", node_id)
        self._verdicts.pop(node_id, None)
        self._retry.pop(node_id, None)  # an operator's word does not wait for a back-off
        if node.layers is None:  # nothing to calibrate on until it is given layers
            self.store.set_state(node_id, NodeState.UP, "")
            return True
        self.store.set_state(node_id, NodeState.CALIBRATING, "")
        self.decide(node_id)
        return True

    def quarantine(self, node_id: str, reason: str, served: Served | None = None) -> None:
        """Take a node out of routing at once, for what it serves, and fail over its
        generations."""
        if served is None:
            node = self.store.node(node_id)
            if node is None or node.layers is None:
                return
            served = (node.fingerprint, node.layers)
        old = self._verdicts.get(node_id)
        if old is not None and old.served == served and not old.passed:
            return  # quarantined already for what it serves
        log.warning("node %s quarantined: %s", node_id, reason)
        self.quarantines += 1
        self._verdicts[node_id] = _Verdict(served, False, reason)
        self.store.set_state(node_id, NodeState.QUARANTINED, reason)
        self.on_quarantine(node_id, reason)
