"""Trust on first fetch: the hashes of tensors the tracker has not read (``header_manifest``).

A node fetching a tensor whose hash the manifest leaves unknown takes it from the hub
(or its own disk), never from a peer (nothing would check a peer's bytes), hashes it,
and reports the hash to its tracker, which keeps the first it is told
(``tracker/serving/manifests.py``) and puts it in every manifest it gives after. When the
tracker already holds another hash for it (another node reported first), the node's
bytes are not the first node's: it fetches the tensor again, checked against that.

A node that would read a tensor from a peer still fetching it (a single flight) first
asks its tracker for the tensor's hash, again and again (bounded), as the peer will
report it once checked: so the hub gives a never-fetched tensor once, too.
"""

from __future__ import annotations

import time
from typing import Protocol

_FIRST_WAIT_S, _MAX_WAIT_S = 0.1, 1.0


class Ledger(Protocol):
    """The tracker's record of learned hashes, as one fetching node reaches it."""

    def recorded(self, name: str) -> str | None:
        """The hash the tracker holds now for tensor ``name`` (None: none yet, or no
        answer)."""

    def report(self, name: str, digest: str) -> str | None:
        """Tell the tracker tensor ``name`` hashed to ``digest``; the hash it holds for
        ``name`` after (``digest`` when it is the first), None when it did not answer."""


def await_hash(ledger: Ledger, name: str, wait_s: float) -> str | None:
    """The hash of ``name`` once the tracker holds one, asking for up to ``wait_s``
    seconds; None when it holds none by then."""
    deadline, wait = time.monotonic() + wait_s, _FIRST_WAIT_S
    while True:
        found = ledger.recorded(name)
        if found is not None or time.monotonic() + wait > deadline:
            return found
        time.sleep(wait)
        wait = min(wait * 2, _MAX_WAIT_S)
