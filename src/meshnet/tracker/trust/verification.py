"""Verification for one served model: trust before routing, checks after the work.

With verification on, a node calibrates on its span before it is routed
(``calibration.NodeTrust``), a fraction of every node's committed chunks is
re-run (``verifier.Verifier``: on chains of trusted nodes where one fits,
``trusted_capacity``, else on the tracker's own engine), every verdict is
recorded, and a failed one quarantines its node, which the tracker then fails
over at once. Trusted nodes (``--trusted-node``: trust is configuration) are
neither calibrated nor checked.

The tracker's use cases (``service``) hand this each committed chunk and tell it
when a node registers or may serve new layers; it tells them of a quarantine.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.model.info import ModelInfo
from meshnet.tracker.accounting.work_checks import SpanCheck
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.nodes.registry import NodeRecord
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.trust.calibration import NodeTrust
from meshnet.tracker.trust.trusted_capacity import TrustedCapacity, run_chain
from meshnet.tracker.trust.verifier import (
    SpanClaim,
    TrustedModel,
    Verdict,
    Verifier,
    mismatch,
)

log = logging.getLogger(__name__)


class Verification:
    """Calibration, sampled checks and their verdicts for one model's nodes."""

    def __init__(
        self,
        store: Store,
        channels: ChannelPool,
        model: ModelInfo,
        reference: TrustedModel,
        rate: float,
        trusted: frozenset[str],
        quarantined: Callable[[str, str], None],
    ) -> None:
        """``reference``: the model checks run on where no trusted chain fits; ``rate``:
        the fraction of chunks checked; ``quarantined(node_id, reason)``: told after a
        node is quarantined, to fail over what runs on it."""
        self.store = store
        self.rate = rate
        self.trusted = trusted
        self.trust = NodeTrust(store, channels, model.fingerprint, reference, quarantined, trusted)
        self.verifier = Verifier(reference, rate, self._checked, backend_of=self._backend_of)
        self.capacity: TrustedCapacity | None = None  # checks on trusted nodes, when any
        if trusted:
            shape = (model.spec.d_model, model.spec.vocab_size)
            run = functools.partial(run_chain, channels, model.fingerprint, shape)
            self.capacity = TrustedCapacity(trusted, model.fingerprint, store.nodes, run)
            self.verifier.elsewhere = self.capacity.check

    def offer(self, claim: SpanClaim) -> None:
        """A committed chunk, for the verifier to sample, unless a trusted node made it."""
        if claim.node_id not in self.trusted:
            self.verifier.offer(claim)

    def withheld(self, claim: SpanClaim) -> None:
        """A chunk its node ran and never committed (span_claims.withheld): work no check
        can reach, failed as a check would (quarantine, its open-window work rejected);
        a trusted node's is logged."""
        verdict = mismatch(claim, "no commitment came of positions it computed")
        if claim.node_id in self.trusted:
            log.error("trusted node %s: %s", claim.node_id, verdict.detail)
            return
        self._checked(verdict)

    def registered(self, node_id: str, before: NodeRecord | None) -> None:
        """A node registered (again): up, or calibrating first."""
        self.trust.decide(node_id, before)

    def reconsider(self, node_id: str) -> None:
        """A node may serve other layers now (a heartbeat, a configure, a heal): it
        calibrates on them before it is routed there."""
        self.trust.decide(node_id)

    def readmit(self, node_id: str) -> bool:
        """Try a quarantined node again: it calibrates afresh before it is routed; False
        when it is not quarantined for this model."""
        return self.trust.readmit(node_id)

    async def calibrated(self, node_id: str) -> bool:
        """Wait for the node's calibration; whether it passed."""
        return await self.trust.calibrated(node_id)

    def _backend_of(self, node_id: str) -> str:
        """The backend a node registered with (the verifier checks its work on it); the
        default one for a node no longer registered."""
        node = self.store.node(node_id)
        return node.backend if node is not None else DEFAULT_BACKEND

    def _checked(self, verdict: Verdict) -> None:
        """Record the verifier's verdict on a span; a failed one quarantines the node
        (first: it must not wait on the database)."""
        c = verdict.claim
        if not verdict.passed and c.node_id in self.trusted:
            # Blamed as a hop before a checked node (the engine's upstream check): trust is
            # configuration, so it stays up; the failed check is kept for the operator.
            log.error(
                "trusted node %s differs from the tracker's engine: %s", c.node_id, verdict.detail
            )
        elif not verdict.passed:
            self.trust.quarantine(c.node_id, f"verification failed: {verdict.detail}")
        self.store.record_check(
            SpanCheck(
                c.node_id,
                c.generation_id,
                c.layers.start,
                c.layers.end,
                c.token_start,
                c.token_end,
                verdict.passed,
                verdict.detail,
            )
        )
