"""Node to node: a hop sends its output straight to the next hop of the route.

The sender keeps one long-lived ``RelayStream`` call per next-hop address (a
unary call per step cost the node as much as the step's compute on the small
model); every frame is answered in order. A ring's inputs move on to the next
hop's relay port (node/relay_socket.py) once the stream's answers offer one and
a connection to it is let in: there a frame costs one write and nothing
answers it unless it is refused. The receiver files the input in its
``Mailbox`` until the driver's step for it (marked ``relayed``) takes it, or
hands it to a hop running ahead (``when``) the moment it comes; inputs can
arrive before or after that step. The mailbox is bounded in entries
and bytes, and inputs nobody took expire, so a peer cannot make a node hold
memory it did not ask for. Inputs that come after their stream ended (a
cancelled generation's previous hop had them on the wire) are the first to go
when the box is full, so they cannot refuse the generations that follow.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import numpy as np

from meshnet.auth.signing import METADATA_KEY
from meshnet.errors import (
    Cancelled,
    DeadlineExceeded,
    MeshnetError,
    Overloaded,
    StreamReset,
    error_for_kind,
)
from meshnet.node.relay_socket import SENDER_IDLE_S, SocketLink
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS
from meshnet.protocol.keepalive import CLIENT_OPTIONS

RelayKey = tuple[str, int, int]  # (session id, epoch, step)
Offered = Callable[[str, str, int], None]  # (address, token, relay port): a port is offered

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting step checks that its call is still wanted
_NO_LINK_S = 60.0  # a next hop whose relay port failed is relayed to by stream meanwhile
_ENDED_KEPT = 4096  # ended streams remembered (for their late inputs) at most


@dataclass
class _Letter:
    x: np.ndarray
    arrived: float  # time.monotonic()


class Mailbox:
    """Inputs relayed by previous hops, by (session, epoch, step); thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float = 60.0) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._letters: dict[RelayKey, _Letter] = {}
        self._waiters: dict[RelayKey, Callable[[np.ndarray], None]] = {}
        self._ended: dict[tuple[str, int], float] = {}  # (session, epoch) -> stream's end
        self._bytes = 0
        self._cond = threading.Condition()
        self.delivered = 0  # inputs taken by their steps

    def put(self, key: RelayKey, x: np.ndarray) -> None:
        """File an input, or hand it to the step waiting for it; ``Overloaded`` when the
        mailbox is full."""
        with self._cond:
            waiter = self._waiters.pop(key, None)
            if waiter is not None:
                self.delivered += 1
        if waiter is not None:
            waiter(x)  # on this (the relay stream's) thread, outside the lock
            return
        with self._cond:
            self._expire(time.monotonic())
            old = self._letters.pop(key, None)
            if old is not None:  # sent again (a retried relay): the newest counts
                self._bytes -= old.x.nbytes
            if self._full(x.nbytes):
                self._drop_leftovers()
            if self._full(x.nbytes):
                raise Overloaded(f"relay mailbox full ({len(self._letters)} inputs waiting)")
            self._letters[key] = _Letter(x, time.monotonic())
            self._bytes += x.nbytes
            self._cond.notify_all()

    def take(
        self, key: RelayKey, timeout_s: float | None, wanted: Callable[[], bool]
    ) -> np.ndarray:
        """The input for ``key``, waiting for it up to ``timeout_s`` while ``wanted()``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                letter = self._letters.pop(key, None)
                if letter is not None:
                    self._bytes -= letter.x.nbytes
                    self.delivered += 1
                    return letter.x
                if not wanted():
                    raise Cancelled(f"step {key[2]} of {key[0]} is no longer wanted")
                left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
                if left <= 0:
                    raise DeadlineExceeded(
                        f"the previous hop sent no input for step {key[2]} of session {key[0]}"
                    )
                self._cond.wait(left)

    def when(self, key: RelayKey, deliver: Callable[[np.ndarray], None]) -> None:
        """Call ``deliver`` with the input for ``key`` as soon as it is here: now, on
        this thread, if it is; else on the thread that files it. One waiter a key."""
        with self._cond:
            letter = self._letters.pop(key, None)
            if letter is None:
                self._waiters[key] = deliver
                return
            self._bytes -= letter.x.nbytes
            self.delivered += 1
        deliver(letter.x)

    def opened(self, session_id: str, epoch: int) -> None:
        """A stream of the session's epoch is open (again: a kept session's next turn):
        its inputs are wanted, not leftovers of an ended stream."""
        with self._cond:
            self._ended.pop((session_id, epoch), None)

    def drop(self, session_id: str, epoch: int) -> None:
        """Forget the inputs of a session's epoch and the steps waiting for them (its
        stream ended); inputs for it that come later are leftovers."""
        with self._cond:
            self._ended.pop((session_id, epoch), None)
            self._ended[(session_id, epoch)] = time.monotonic()
            while len(self._ended) > _ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
            for key in [k for k in self._letters if k[:2] == (session_id, epoch)]:
                self._bytes -= self._letters.pop(key).x.nbytes
            for key in [k for k in self._waiters if k[:2] == (session_id, epoch)]:
                del self._waiters[key]

    def _full(self, more_bytes: int) -> bool:
        return len(self._letters) >= self.max_entries or self._bytes + more_bytes > self.max_bytes

    def _drop_leftovers(self) -> None:
        for key in [k for k in self._letters if k[:2] in self._ended]:
            self._bytes -= self._letters.pop(key).x.nbytes

    def _expire(self, now: float) -> None:
        for key in [k for k, v in self._letters.items() if now - v.arrived > self.ttl_s]:
            self._bytes -= self._letters.pop(key).x.nbytes
        while self._ended:
            first = next(iter(self._ended))
            if now - self._ended[first] <= self.ttl_s:
                break
            del self._ended[first]


class RelaySender:
    """Sends outputs to next hops; thread-safe.

    A step driven by the tracker (``send``) goes over one ``RelayStream`` per
    address and waits for its answer. A ring's inputs (``relay``) go over the next
    hop's relay port (node/relay_socket.py) once a connection to it is let in, and
    over the ``RelayStream`` until then, or for good where there is none (a peer
    that offers no port, one that cannot be reached or refuses the connection).
    """

    def __init__(self) -> None:
        self._streams: dict[str, _RelayStream] = {}
        self._links: dict[str, SocketLink] = {}
        self._no_link_until: dict[str, float] = {}  # addresses whose port failed, until
        self._ports: dict[str, int] = {}  # each address's relay port, once linked
        self._connecting: set[str] = set()
        self._lock = threading.Lock()

    def send(self, address: str, token: str, frame: pb.RelayFrame, timeout_s: float) -> None:
        """Deliver one step's output; a typed failure (of the next hop) when it cannot.
        ``token``: the tracker's leave to relay there, shown when a stream opens."""
        answer = self.post(address, token, frame)
        try:
            ack = answer.result(timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(f"{address} did not take a relayed input") from None
        check_ack(ack, address)

    def post(self, address: str, token: str, frame: pb.RelayFrame) -> Future[pb.RelayAck]:
        """Send one step's output over the ``RelayStream`` without waiting: the next
        hop's answer, to come (a broken stream sets the future's exception)."""
        with self._lock:
            stream = self._streams.get(address)
            if stream is None or stream.broken is not None:  # a new stream after a failure
                stream = self._streams[address] = _RelayStream(address, token, self._offered)
        return stream.post(frame)

    def relay(
        self,
        address: str,
        token: str,
        key: RelayKey,
        x: np.ndarray,
        on_failure: Callable[[MeshnetError], None],
    ) -> None:
        """Send a ring's input without waiting for it to be taken; ``on_failure`` is
        told if it (or a later input of its session's epoch) is refused, or the way
        there breaks, until ``forget``."""
        with self._lock:
            link = self._links.get(address)
            if link is not None and link.broken is None and link.idle_s() > SENDER_IDLE_S:
                del self._links[address]  # before the next hop's idle cut can meet a send
                link.retire()
                link = None
        if link is not None and link.broken is None:
            link.send(*key, x, on_failure)
            return
        session_id, epoch, step = key
        frame = pb.RelayFrame(session_id=session_id, epoch=epoch, step=step, input=codec.encode(x))
        answer = self.post(address, token, frame)
        answer.add_done_callback(lambda a: _tell_refusal(a, address, on_failure))

    def port_of(self, address: str) -> int | None:
        """The relay port of ``address`` while a link to it is up; else None."""
        with self._lock:
            link = self._links.get(address)
            return self._ports.get(address) if link is not None and link.broken is None else None

    def forget(self, address: str, session_id: str, epoch: int) -> None:
        """The run of (session, epoch) is over: its ``on_failure`` is told nothing more."""
        with self._lock:
            link = self._links.get(address)
        if link is not None:
            link.forget(session_id, epoch)

    def close(self) -> None:
        with self._lock:
            for stream in self._streams.values():
                stream.close()
            for link in self._links.values():
                link.close()
            self._streams.clear()
            self._links.clear()

    def _offered(self, address: str, token: str, port: int) -> None:
        """The next hop at ``address`` offers its relay port: connect in the background
        (inputs keep to the stream meanwhile), unless a link is up or being made, or
        the port failed lately."""
        with self._lock:
            link = self._links.get(address)
            if (link is not None and link.broken is None) or address in self._connecting:
                return
            if self._no_link_until.get(address, 0.0) > time.monotonic():
                return
            self._connecting.add(address)
        threading.Thread(
            target=self._connect, args=(address, token, port), name="relay-connect", daemon=True
        ).start()

    def _connect(self, address: str, token: str, port: int) -> None:
        host = address.rsplit(":", 1)[0].strip("[]")
        link: SocketLink | None = None
        try:
            link = SocketLink.connect(host, port, token, address)
        except (OSError, MeshnetError) as e:
            log.info("relaying to %s over its stream: its relay port: %s", address, e)
        with self._lock:
            self._connecting.discard(address)
            if link is None:
                self._no_link_until[address] = time.monotonic() + _NO_LINK_S
            else:
                self._links[address] = link
                self._ports[address] = port
        if link is not None:
            log.info("relaying to %s over its relay port %d", address, port)


def _tell_refusal(
    answer: Future[pb.RelayAck], address: str, on_failure: Callable[[MeshnetError], None]
) -> None:
    try:
        check_ack(answer.result(), address)
    except MeshnetError as e:
        on_failure(e)


class _RelayStream:
    """One long-lived call to a next hop: frames go in order and are answered in order.

    A reader thread matches each answer to the oldest frame still waiting (one
    whose sender gave up waiting keeps its place), so order is never lost.
    """

    def __init__(self, address: str, token: str, offered: Offered) -> None:
        self.address = address
        self._token = token
        self._offered = offered
        self.broken: MeshnetError | None = None
        self._channel = grpc.insecure_channel(address, options=[*MESSAGE_OPTIONS, *CLIENT_OPTIONS])
        self._frames: queue.Queue[pb.RelayFrame | None] = queue.Queue()
        self._waiting: deque[Future[pb.RelayAck]] = deque()
        self._lock = threading.Lock()
        stub = pb_grpc.NodeStub(self._channel)
        self._call = stub.RelayStream(
            iter(self._frames.get, None), metadata=((METADATA_KEY, token),)
        )
        threading.Thread(target=self._read, name="relay-acks", daemon=True).start()

    def post(self, frame: pb.RelayFrame) -> Future[pb.RelayAck]:
        answer: Future[pb.RelayAck] = Future()
        with self._lock:
            if self.broken is not None:
                answer.set_exception(self.broken)
                return answer
            self._waiting.append(answer)
            self._frames.put(frame)
        return answer

    def close(self) -> None:
        self._frames.put(None)
        self._call.cancel()
        self._channel.close()

    def _read(self) -> None:
        error: MeshnetError = StreamReset(f"the relay stream to {self.address} ended")
        try:
            for ack in self._call:
                if ack.relay_port:
                    self._offered(self.address, self._token, ack.relay_port)
                with self._lock:
                    answer = self._waiting.popleft() if self._waiting else None
                if answer is not None:
                    answer.set_result(ack)
        except grpc.RpcError as e:
            error = _relay_failure(e, self.address)
        with self._lock:
            self.broken = error
            waiting, self._waiting = self._waiting, deque()
        for answer in waiting:
            answer.set_exception(error)
        self._frames.put(None)  # ends the request iterator if the call is still open


def check_ack(ack: pb.RelayAck, address: str) -> None:
    """Raise the next hop's refusal of a relayed input, typed."""
    if ack.HasField("failure"):
        raise error_for_kind(ack.failure.kind, f"{address}: {ack.failure.message}")


def _relay_failure(e: grpc.RpcError, address: str) -> MeshnetError:
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    detail = e.details() if isinstance(e, grpc.Call) else str(e)
    message = f"relay to {address} failed: {code.name} {detail or ''}".strip()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    return StreamReset(message)
