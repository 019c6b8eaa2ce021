"""Head assist: a ring's last hop shares its output head's multiply with the first hop.

A decode step of one stream keeps one node busy at a time: while the last hop runs
its layers and head, the first waits for the token. Where the head is tied (it is the
token embedding, which the first hop holds too), the last hop asks the first for the
logits of the head's first ``k`` rows (``relay_socket.HeadLink``), multiplies the
rest itself meanwhile, and takes the first's part when it comes in time, else
multiplies those rows as well. Either way the logits are bit-identical to one
multiply (``quant.row_range``), so the sampled token is too.

``k`` is chosen so both sides finish together: from the time a row of its own part
takes and the first hop's measured turnaround, a fixed cost (two wake-ups, the
bytes both ways) plus its rows. Finishing together is not yet finishing sooner:
where the two nodes share a memory bus (one host's cores), each side's multiply
slows while the other's runs, so every ``PROBE_EVERY`` parts the head is
multiplied alone a few times, and a peer whose parts saved too little of that
time is not asked for a while. A first hop that answers late (a slow link, a busy
node) is not asked for a while; one that refuses (not the first shard, another
file or backend) is not asked again. The first hop's answers are trusted as the
ring's own: a node asks only when its operator says so (``meshnet node
--head-assist``), as ``meshnet up``'s nodes, one operator's processes, do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from meshnet.backends import quant
from meshnet.backends.fast import FastBackend
from meshnet.backends.quant import QuantMatrix
from meshnet.backends.quant_layouts import GROUP_ROWS
from meshnet.backends.shard import Shard
from meshnet.errors import MalformedBundle, MeshnetError
from meshnet.node.relay_socket import HeadLink
from meshnet.node.relay_wire import Ask

log = logging.getLogger(__name__)

FIRST_SHARE = 0.3  # of the head's rows asked of the peer before anything is measured
MAX_SHARE = 0.6  # a peer never gets more than this: the last hop's own part hides its wait
MAX_LATE = 3  # parts late in a row before a peer is not asked for a while
LATE_PAUSE_S = 10.0  # a peer that answered late (or whose link broke) is not asked meanwhile
REFUSED_PAUSE_S = 300.0  # nor one that refused to answer
MAX_PEERS = 16  # first hops a node keeps an assist for (the oldest made goes)
PROBE_EVERY = 32  # parts in time between two measures of the head multiplied alone
PROBE_RUNS = 3  # multiplies alone one measure takes (their median counts)
MIN_GAIN = 0.03  # of the head alone's time: the least saving that keeps a peer asked
NO_GAIN_PAUSE_S = 60.0  # a peer whose parts saved less is not asked meanwhile
_DRAIN_S = 0.002  # the wait, after a late part was done here, for it to come anyway
_STEP = 0.01  # of the head's rows: the share's rise after a part that came early

Connect = Callable[[], HeadLink]  # a new link to the peer; raises OSError or MeshnetError


class HeadAssist:
    """Splits one node's single-row head multiplies with one peer; thread-safe: one
    caller at a time asks, another meanwhile multiplies alone."""

    def __init__(
        self,
        connect: Connect,
        fingerprint: str,
        backend: str,
        clock: Callable[[], float] = time.perf_counter,
        address: str = "the first hop",
    ) -> None:
        self.address = address  # the peer's, for logs and its registry
        self._connect = connect
        self._fingerprint = fingerprint
        self._backend = backend
        self._clock = clock
        self._link: HeadLink | None = None
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self.share = FIRST_SHARE  # of the head's rows the next ask gives the peer
        self.asked = 0  # asks answered in time
        self.late = 0  # asks this node finished itself
        self._lates = 0  # of them, in a row
        self._with: list[float] = []  # seconds of each multiply shared since the last measure
        self._alone: list[float] = []  # seconds of this measure's multiplies alone

    def logits(self, normed: np.ndarray, head: QuantMatrix) -> np.ndarray:
        """``normed`` [1, d] times ``head`` [vocab, d]: [1, vocab], exactly as one
        ``quant.matmul`` gives it."""
        k = self._split(head.rows)
        if normed.shape[0] != 1 or k == 0 or not self._lock.acquire(blocking=False):
            return quant.matmul(normed, head)
        try:
            if len(self._with) >= PROBE_EVERY:
                return self._probe(normed, head)
            return self._shared(normed, head, k)
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._drop_link()

    def _split(self, rows: int) -> int:
        """The rows to ask of the peer now: whole groups of 16, or 0 (multiply alone)."""
        if self._clock() < self._paused_until:
            return 0
        k = int(rows * self.share) // GROUP_ROWS * GROUP_ROWS
        return k if 0 < k < rows else 0

    def _probe(self, normed: np.ndarray, head: QuantMatrix) -> np.ndarray:
        """The head multiplied alone, timed; after ``PROBE_RUNS`` of them, the peer is
        kept only if its parts saved at least ``MIN_GAIN`` of that time."""
        start = self._clock()
        out = quant.matmul(normed, head)
        self._alone.append(self._clock() - start)
        if len(self._alone) >= PROBE_RUNS:
            alone, shared = float(np.median(self._alone)), float(np.median(self._with))
            self._with, self._alone = [], []
            if shared > alone * (1 - MIN_GAIN):
                why = f"it saves too little here: {shared * 1e3:.2f} ms a head with it, "
                self._pause(NO_GAIN_PAUSE_S, why + f"{alone * 1e3:.2f} ms alone")
        return out

    def _shared(self, normed: np.ndarray, head: QuantMatrix, k: int) -> np.ndarray:
        fresh = self._link is None  # a new link's first answer is slow: not learnt from
        start = self._clock()
        try:
            link = self._link = self._link or self._connect()
            ask = link.ask(normed, k, self._fingerprint, self._backend)
        except OSError as e:
            self._pause(LATE_PAUSE_S, f"could not ask: {e}")
            return quant.matmul(normed, head)
        except MeshnetError as e:  # refused (or the ask could not be laid out)
            self._pause(REFUSED_PAUSE_S, f"could not ask: {e}")
            return quant.matmul(normed, head)
        sent = self._clock()
        mine = quant.matmul(normed, quant.row_range(head, k, head.rows))
        done = self._clock()
        row_s = (done - sent) / (head.rows - k)
        early = link.ready()  # the peer's part came before this node's was done
        theirs: np.ndarray | None = None
        try:
            theirs = link.part(ask, timeout_s=max(row_s * k, 1e-4))
        except TimeoutError:
            self._late(link, ask, head.rows)
        except MeshnetError as e:
            refused = not isinstance(e, MalformedBundle)
            self._pause(REFUSED_PAUSE_S if refused else LATE_PAUSE_S, str(e))
        except OSError as e:
            self._pause(LATE_PAUSE_S, f"its link broke: {e}")
        else:
            self.asked += 1
            self._lates = 0
            if not fresh:
                self._learn(row_s, 0.0 if early else self._clock() - done, head.rows)
        if theirs is None:  # the peer's part did not come: done here
            theirs = quant.matmul(normed, quant.row_range(head, 0, k))
        elif not fresh:
            self._with.append(self._clock() - start)
        return np.concatenate([theirs, mine], axis=1)

    def _learn(self, row_s: float, waited_s: float, rows: int) -> None:
        """Move the share toward where both sides finish together: up a step when the
        peer's part was there first; down, when this node waited for it, by the rows
        whose move from the peer to this node would have met halfway."""
        if waited_s <= 0.0:
            self.share = min(self.share + _STEP, MAX_SHARE)
        else:  # at most a few steps: one hiccup is not a trend
            self._shrink(min(waited_s / (2 * row_s * rows), _STEP * 5), rows)

    def _shrink(self, by: float, rows: int) -> None:
        self.share -= by
        if self.share * rows < GROUP_ROWS:
            self._pause(LATE_PAUSE_S, "its turnaround costs more than it saves")

    def _late(self, link: HeadLink, ask: Ask, rows: int) -> None:
        """The peer's part did not come in time: it was done here. Its answer is read
        off if it has come meanwhile (else the link, out of step, is dropped); the
        share shrinks, and a peer late ``MAX_LATE`` times running is not asked a while."""
        self.late += 1
        self._lates += 1
        try:
            link.part(ask, timeout_s=_DRAIN_S)
        except (TimeoutError, OSError, MeshnetError):
            self._drop_link()
        if self._lates >= MAX_LATE:
            self._pause(LATE_PAUSE_S, f"it answered late {self._lates} times running")
        else:
            self._shrink(_STEP * 5, rows)

    def _pause(self, seconds: float, why: str) -> None:
        log.info("head assist: not asking %s for %.0f s: %s", self.address, seconds, why)
        self._drop_link()
        self._paused_until = self._clock() + seconds
        self.share = FIRST_SHARE
        self._lates = 0
        self._with, self._alone = [], []

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None


class HeadAssists:
    """A node's head assists, one per first hop (model file and backend) it asks."""

    def __init__(self, port_of: Callable[[str], int | None]) -> None:
        self._port_of = port_of  # a next hop's relay port, once a link to it is up
        self._assists: dict[tuple[str, str, str], HeadAssist] = {}
        self._tokens: dict[str, str] = {}
        self._lock = threading.Lock()

    def for_hop(self, address: str, token: str, shard: Shard) -> HeadAssist | None:
        """The assist asking the ring's first hop at ``address`` (``token``: the
        tracker's leave to relay there); None where the head is not tied and
        quantized, or no relay port of that hop is known yet."""
        backend = shard.backend
        if not (shard.spec.tied_head and isinstance(backend, FastBackend)):
            return None
        port = self._port_of(address)
        if port is None:
            return None
        key = (address, shard.fingerprint, backend.name)
        with self._lock:
            self._tokens[address] = token  # a later leave replaces an earlier one
            assist = self._assists.get(key)
            if assist is None:
                host = address.rsplit(":", 1)[0].strip("[]")

                def connect() -> HeadLink:
                    return HeadLink.connect(host, port, self._tokens[address], address)

                assist = HeadAssist(connect, shard.fingerprint, backend.name, address=address)
                self._assists[key] = assist
                while len(self._assists) > MAX_PEERS:  # first hops of routes long gone
                    gone = self._assists.pop(next(iter(self._assists)))
                    gone.close()
                    if all(a != gone.address for a, _, _ in self._assists):
                        self._tokens.pop(gone.address, None)
        return assist

    def counts(self) -> tuple[int, int]:
        """(head parts answered in time, asked and done here instead), over every peer."""
        with self._lock:
            assists = list(self._assists.values())
        return sum(a.asked for a in assists), sum(a.late for a in assists)

    def close(self) -> None:
        with self._lock:
            assists, self._assists = list(self._assists.values()), {}
        for assist in assists:
            assist.close()
