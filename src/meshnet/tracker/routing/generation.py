"""One generation's state in the tracker: its epoch, links, input log and recoveries.

The input log keeps, per layer boundary, what every step fed the hop that
starts there. It is what failover replays into a replacement, so only the
failed span is recomputed. A session's turn starts with the log of the first
layer filled with the session's history (its earlier steps), so any hop that
lacks the KV can be rebuilt from token zero. The generation can be failed from outside (a node
of its route lost its heartbeats, a client cancelled it): the verdict is set
on the affected links and their calls are cancelled, which wakes the step
waiting on them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from meshnet.errors import Cancelled, MeshnetError
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord
from meshnet.tracker.links import commitments
from meshnet.tracker.links.hop_link import HopLink
from meshnet.tracker.nodes.routes import Route
from meshnet.tracker.routing.ring import Ring


@dataclass(frozen=True)
class Recovery:
    """What one failover did, as reported to the client and the logs."""

    failed_node: str
    kind: str  # the failure kind that triggered it
    method: str  # "replay" (only the failed span recomputed) or "restart" (from token zero)
    epoch: int  # the epoch it opened
    replacement: tuple[str, ...]  # nodes that recomputed the lost span
    healed: str | None  # an empty node told to load the span, if one was
    replayed_steps: int
    ms: float  # from the failure to the next token

    def as_json(self) -> dict[str, object]:
        return {
            "failed_node": self.failed_node,
            "kind": self.kind,
            "method": self.method,
            "epoch": self.epoch,
            "replacement": list(self.replacement),
            "healed": self.healed,
            "replayed_steps": self.replayed_steps,
            "ms": round(self.ms, 1),
        }


@dataclass
class PendingRecovery:
    """A failover whose replacement has not yet produced the next token."""

    failed_node: str
    kind: str
    started: float  # time.monotonic() when the failure was seen
    failures: dict[str, str] = field(default_factory=dict)  # node -> kind, this recovery
    epoch: int = 0
    method: str = ""
    replacement: tuple[str, ...] = ()
    healed: str | None = None
    replayed_steps: int = 0

    def done(self) -> Recovery:
        ms = (time.monotonic() - self.started) * 1000
        return Recovery(
            self.failed_node,
            self.kind,
            self.method,
            self.epoch,
            self.replacement,
            self.healed,
            self.replayed_steps,
            ms,
        )


@dataclass
class Generation:
    id: str
    route: Route
    deadline: float  # time.monotonic() by which it must end
    params: SamplingParams  # with its seed fixed: the route's last hop samples with it
    top_logprobs: int = -1  # alternatives reported with each token; -1: no log-probabilities
    epoch: int = 1
    session_id: str = ""  # what the nodes key the KV by; the generation id when empty
    keep: bool = False  # the nodes keep the KV after the generation (a session's turn)
    first_step: int = 0  # steps of the session before this generation
    # Positions below this were computed (and billed) by the session's earlier turns on
    # every hop: a failover that recomputes them is the mesh's cost, not billed again.
    billed_from: int = 0
    reused: int = 0  # prompt positions the hops started with from their prefix caches
    prefix_scope: bytes = b""  # whose prefix cache entries those are: its tenant's
    links: list[HopLink] = field(default_factory=list)
    ring: Ring | None = None  # the readers of ``links`` while they run round a ring
    inputs: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # layer -> step -> x
    recoveries: list[Recovery] = field(default_factory=list)
    pending: PendingRecovery | None = None
    failovers: int = 0  # tries to fail over, counting those whose new epoch failed to open
    verdict: MeshnetError | None = None  # set when cancelled from outside
    ready_at: float | None = None  # time.monotonic() when every hop held the history
    draws: int = 0  # uniforms the request's generator has drawn: its position
    history: list[int] = field(default_factory=list)  # ids a penalty or a grammar sees
    first_sampled: int = 0  # position of the first id this generation sampled
    sampled_by: dict[int, str] = field(default_factory=dict)  # position -> node that picked it

    @property
    def kv_key(self) -> str:
        return self.session_id or self.id

    def record_input(self, layer_start: int, step: int, x: np.ndarray) -> None:
        self.inputs.setdefault(layer_start, {}).setdefault(step, x)

    def recorded_input(self, layer_start: int, step: int) -> np.ndarray | None:
        return self.inputs.get(layer_start, {}).get(step)

    def has_inputs(self, layer_start: int, steps: int) -> bool:
        """Whether every step before ``steps`` is logged at ``layer_start``."""
        log = self.inputs.get(layer_start, {})
        return all(s in log for s in range(steps))

    def step_rows(self, step: int) -> int:
        """Rows (tokens) of a step, read off the first layer's log."""
        x = self.recorded_input(0, step)
        return 0 if x is None else int(x.shape[0])

    def cancel(self, reason: str) -> None:
        """Stop the generation; its step in flight ends with ``cancelled``."""
        self.verdict = self.verdict or Cancelled(reason)
        for link in self.links:
            link.fail(self.verdict)

    def node_lost(self, node_id: str, verdict: MeshnetError) -> bool:
        """A node of the route was found dead elsewhere; True if this generation used it."""
        hit = [link for link in self.links if link.node_id == node_id]
        for link in hit:
            link.fail(verdict)
        return bool(hit)

    def attempts(
        self, links: list[HopLink], status: AttemptStatus, kind: str = ""
    ) -> Iterator[LedgerRecord]:
        for link in links:
            yield LedgerRecord(
                generation_id=self.id,
                epoch=link.epoch,
                node_id=link.node_id,
                layer_start=link.hop.layers.start,
                layer_end=link.hop.layers.end,
                token_start=max(link.first_position, self.billed_from),
                token_end=max(link.positions, self.billed_from),
                status=status,
                kind=kind,
                commitments=commitments.encode(
                    commitments.committed(link.commitments, link.positions)
                ),
            )
