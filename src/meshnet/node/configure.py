"""Answering a node's ``Configure`` call: a checked change of one tier run on the engine
(docs/design.md §11; the tiers and their checks: node/tiers.py).

``Configurator`` parses and checks a change, then hands it to the engine's loop
(node/engine_tiers.py) and answers with the node's settings after, or the typed
reason nothing changed; ``StreamLimit`` is the Forward streams' gate whose size
T1 moves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

from meshnet.backends.shard import load_shard
from meshnet.errors import MeshnetError, Overloaded, RequestError
from meshnet.memory import trim
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import read_spec
from meshnet.model_source.reference import is_reference
from meshnet.node.engine import NodeEngine
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.model_fetch import NodeModels
from meshnet.node.tiers import (
    Batching,
    Change,
    Limits,
    ShardLoad,
    Unload,
    check_batching,
    check_limits,
    parse,
    settings,
    tier,
)
from meshnet.node.wire import CONTROL_TIMEOUT_S, fail
from meshnet.protocol import meshnet_pb2 as pb

T = TypeVar("T")


class Configurator:
    """Answers ``Configure`` calls for one engine, one at a time (a second is refused
    ``overloaded``): parse, check every value, then hand the change to the engine's loop.

    A T3 change opens and checks the file (in the node's model dirs, a GGUF of a
    supported model, the range inside its layers) and loads the new shard on the
    calling thread while the old one keeps serving; only the swap waits for the drain.
    The same model and range as served is loaded again, its sessions' KV parked on
    the node's disk meanwhile (``keeps_kv``): their next turn resumes from it.
    """

    def __init__(
        self,
        engine: NodeEngine,
        dirs: ModelDirs,
        start_model: str | None,
        stream_ceiling: int,
        models: NodeModels | None = None,
    ) -> None:
        self._engine = engine
        self._dirs = dirs
        self._start_model = start_model
        self._models = models  # fetches referenced models' ranges (None: references refused)
        self._stream_ceiling = stream_ceiling
        self._busy = threading.Lock()

    def configure(self, request: pb.ConfigureRequest) -> pb.ConfigureResponse:
        """The answer to ``request``: applied (or, ``check_only``, checked) with the node's
        settings after, or the typed reason nothing changed. Any gRPC thread may call it."""
        if not self._busy.acquire(blocking=False):
            return self._reply(Overloaded("another configure is running on this node"))
        try:
            return self._configure(request)
        except MeshnetError as e:
            return self._reply(e)
        finally:
            self._busy.release()

    def _configure(self, request: pb.ConfigureRequest) -> pb.ConfigureResponse:
        change = parse(request, self._start_model)
        check = request.check_only
        if isinstance(change, Limits):
            check_limits(change, self._stream_ceiling)
            if check:
                return self._answer(change, False, "checked: the limits can be applied")
            self._engine.tiers.configure_limits(change).result(CONTROL_TIMEOUT_S)
            return self._answer(change, True, "limits applied")
        if isinstance(change, Batching):
            check_batching(change, self._engine.config, self._engine.stats().kv_bytes)
            if check:
                return self._answer(change, False, "checked: the batching can be applied")
            self._drained(self._engine.tiers.configure_batching(change))
            return self._answer(change, True, "batching applied at a step boundary")
        if isinstance(change, Unload):
            return self._unload(change, check)
        return self._load(change, check)

    def _unload(self, change: Unload, check: bool) -> pb.ConfigureResponse:
        if check:
            return self._answer(change, False, "checked: the node can be emptied")
        ended = self._drained(self._engine.tiers.swap(None))
        reply = self._answer(change, True, f"unloaded: empty; {ended} sessions' KV dropped")
        reply.sessions_ended = ended
        return reply

    def _load(self, change: ShardLoad, check: bool) -> pb.ConfigureResponse:
        if is_reference(change.model_path):
            if self._models is None:
                raise RequestError("this node fetches no model by reference")
            if check:  # the manifest, not the tensors: a check moves no weights
                self._models.manifest(change.model_path)
                return self._answer(change, False, f"checked: {change.model_path} is served")
            local = self._models.shard(change.model_path, change.layers)
            fetched: Path | None = local.path
            f = open_gguf(local.path, local.fingerprint)
        else:
            fetched = None
            f = open_gguf(self._dirs.resolve(change.model_path))
        spec = read_spec(f)
        change.layers.check_within(spec.n_layers)
        now = self._engine.shard
        served = (now.fingerprint, now.layers) if now is not None else None
        keeps = served == (f.fingerprint(), change.layers)  # a reload: the KV still fits
        if check:
            return self._answer(change, False, f"checked: {change.layers} can be loaded", keeps)
        try:
            shard = load_shard(f, spec, change.layers, self._engine.config.backend)
        except MemoryError:
            raise RequestError(f"not enough memory to load {change.layers}") from None
        del f  # the header's values go (a large vocabulary is tens of MB of strings)
        trim()  # and the memory they held goes back to the system
        ended = self._drained(self._engine.tiers.swap(shard))
        if self._models is not None:
            self._models.serving(fetched)  # what the node served before is dropped
        if keeps:
            detail = f"reloaded {change.layers}; sessions' KV parked on the node, {ended} lost"
        else:
            detail = f"now serving {change.layers}; {ended} sessions' KV dropped"
        reply = self._answer(change, True, detail, keeps)
        reply.sessions_ended = ended
        return reply

    def _drained(self, future: Future[T]) -> T:
        return _drained(future, self._engine.config.drain_timeout_s)

    def _answer(
        self, change: Change, applied: bool, detail: str, keeps_kv: bool = False
    ) -> pb.ConfigureResponse:
        reply = self._reply(None)
        reply.applied = applied
        reply.tier = tier(change)
        reply.detail = detail
        reply.keeps_kv = keeps_kv
        return reply

    def _reply(self, error: MeshnetError | None) -> pb.ConfigureResponse:
        """The node as it is now, and why nothing was applied (when ``error``)."""
        shard = self._engine.shard
        reply = pb.ConfigureResponse(settings=settings(self._engine.config))
        if shard is not None:
            reply.layer_start, reply.layer_end = shard.layers.start, shard.layers.end
            reply.fingerprint = shard.fingerprint
        if error is not None:
            reply.failure.CopyFrom(fail(error))
        return reply


def _drained(future: Future[T], timeout_s: float) -> T:
    """Wait for a staged change; one the node did not drain for in time is withdrawn."""
    try:
        return future.result(timeout_s)
    except TimeoutError:
        if future.cancel():
            raise Overloaded(
                f"the node did not drain within {timeout_s:g} s: nothing changed"
            ) from None
        return future.result()  # it was being applied as the wait ended


class StreamLimit:
    """The gate of Forward streams: at most ``limit()`` held at once, read at each acquire,
    so a T1 change applies to the next stream. Lowering it ends no stream already held."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = False) -> bool:
        """Take a stream if one is free (never waits: ``blocking`` is for the
        semaphore's signature only)."""
        with self._lock:
            if self._held >= self._limit():
                return False
            self._held += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._held <= 0:
                raise ValueError("a stream released more often than taken")
            self._held -= 1

    @property
    def held(self) -> int:
        return self._held
