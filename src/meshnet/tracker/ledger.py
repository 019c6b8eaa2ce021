"""The work ledger: one record per attempt per shard, and what of it is billable.

An *attempt* is one node serving one layer range of one generation for one
epoch. It is recorded once, when the attempt ends, with the token positions
it computed in that epoch and how it ended:

- ``completed``: its KV was used to the end (or carried into the next epoch
  by a resume, which starts the next attempt where this one stopped);
- ``failed``: the node failed; its work is discarded and redone elsewhere;
- ``cancelled``: the work was abandoned (client gone, explicit cancel, the
  generation failed elsewhere, or the KV was lost and recomputed);
- ``unverified``: computed but not yet checked by the verifier.

Because a resumed attempt starts at the position the previous one reached and
a replacement recomputes only what failed, the completed records of one
generation cover each layer's token positions exactly once: retries and
replays are never billed twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AttemptStatus(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    UNVERIFIED = "unverified"


BILLABLE = frozenset({AttemptStatus.COMPLETED})


@dataclass(frozen=True)
class LedgerRecord:
    generation_id: str  # the session id the nodes know the generation by
    epoch: int
    node_id: str
    layer_start: int
    layer_end: int
    token_start: int  # first KV position this attempt computed
    token_end: int  # one past the last
    status: AttemptStatus
    kind: str = ""  # the failure kind that ended it, when it did not complete

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def billable(self) -> bool:
        return self.status in BILLABLE

    @property
    def layer_tokens(self) -> int:
        """Work done: tokens times layers, the unit per-node totals are kept in."""
        return self.tokens * (self.layer_end - self.layer_start)
