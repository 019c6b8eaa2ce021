"""Live configuration of a node, in three tiers, checked before anything moves (docs/design.md §11).

- **T1** (``Limits``) applies at once: Forward streams held at once, steps queued
  before ``overloaded``, the process's log level. A node has no sampling
  defaults: every request's sampling travels with its ``Open``.
- **T2** (``Batching``) applies at the next step boundary at which no prompt is
  half-run (a prefill cut into chunks keeps one chunk size from its first row to
  its last, so its results never depend on when the change came): rows per
  forward, prompt rows per session per forward, the KV budget.
- **T3** (``ShardLoad``) swaps the shard: the node drains (opens refused,
  half-run prompts finish, queued steps miss), drops its sessions' KV, which is
  no use to other layers or another model (the same model and layers again
  park it instead), and serves the new layers; its heartbeat carries them.
  ``LoadShard`` with no model path and layers ``[0, 0)`` unloads instead
  (``Unload``): the node drains, drops every session's KV and is empty, ready
  for its next load (the tracker frees a released model's nodes so).

Every value is checked here, in pure functions, before the engine is asked to
change; a refused change raises ``RequestError`` with the reason and changes
nothing. ``Configurator`` runs a checked change on the engine (whose loop
applies it) and answers the ``Configure`` call; ``StreamLimit`` is the Forward
streams' gate whose size T1 moves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from meshnet.errors import MalformedBundle, MeshnetError, Overloaded, RequestError
from meshnet.layer_range import LayerRange
from meshnet.memory import settle
from meshnet.model.gguf_file import open_gguf
from meshnet.model.shard import load_shard
from meshnet.model.spec import read_spec
from meshnet.model_source.reference import is_reference
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.wire import CONTROL_TIMEOUT_S, fail
from meshnet.protocol import meshnet_pb2 as pb

if TYPE_CHECKING:
    from meshnet.node.engine import EngineConfig, NodeEngine
    from meshnet.node.model_fetch import NodeModels

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_QUEUED_STEPS = 1 << 16  # more would only queue work no deadline lets finish
MAX_BATCH_TOKENS = 1 << 16  # rows of one forward: activations of [rows, d] per layer
MAX_KV_BUDGET_BYTES = 1 << 46  # 64 TiB: past any machine's memory, a typo


@dataclass(frozen=True)
class Limits:
    """Tier 1; None leaves a value as it is."""

    max_streams: int | None = None
    max_queued_steps: int | None = None
    log_level: str | None = None


@dataclass(frozen=True)
class Batching:
    """Tier 2; None leaves a value as it is."""

    max_batch_tokens: int | None = None
    prefill_chunk: int | None = None
    kv_budget_bytes: int | None = None  # 0: unlimited


@dataclass(frozen=True)
class ShardLoad:
    """Tier 3: the model file (as named; resolved against the node's model dirs) and layers."""

    model_path: str
    layers: LayerRange


@dataclass(frozen=True)
class Unload:
    """Tier 3 to empty: drop the shard and every session's KV; the node waits for a load."""


Change = Limits | Batching | ShardLoad | Unload


def parse(request: pb.ConfigureRequest, start_model: str | None) -> Change:
    """The typed change a ``ConfigureRequest`` asks for; ``MalformedBundle`` when it
    names none, ``RequestError``/``LayerRangeError`` for a bad range or no model."""
    kind = request.WhichOneof("kind")
    if kind == "limits":
        m = request.limits
        return Limits(
            max_streams=m.max_streams if m.HasField("max_streams") else None,
            max_queued_steps=m.max_queued_steps if m.HasField("max_queued_steps") else None,
            log_level=m.log_level.upper() or None,
        )
    if kind == "batching":
        b = request.batching
        return Batching(
            max_batch_tokens=b.max_batch_tokens if b.HasField("max_batch_tokens") else None,
            prefill_chunk=b.prefill_chunk if b.HasField("prefill_chunk") else None,
            kv_budget_bytes=b.kv_budget_bytes if b.HasField("kv_budget_bytes") else None,
        )
    if kind == "load":
        m = request.load
        if not m.model_path and m.layer_start == 0 and m.layer_end == 0:
            return Unload()
        path = m.model_path or start_model
        if not path:
            raise RequestError("no model path given and none configured at start")
        return ShardLoad(path, LayerRange(request.load.layer_start, request.load.layer_end))
    raise MalformedBundle("a Configure names no tier (load, limits or batching)")


def tier(change: Change) -> str:
    """``t1``, ``t2`` or ``t3``: what a response and a log line call the change."""
    return {Limits: "t1", Batching: "t2", ShardLoad: "t3", Unload: "t3"}[type(change)]


def check_limits(limits: Limits, stream_ceiling: int) -> None:
    """Refuse T1 values out of bounds. ``stream_ceiling``: the streams the node's server
    was sized for at start (each holds a server thread; more would starve control calls)."""
    _bounded("max_streams", limits.max_streams, 1, stream_ceiling)
    _bounded("max_queued_steps", limits.max_queued_steps, 1, MAX_QUEUED_STEPS)
    if limits.log_level is not None and limits.log_level not in LOG_LEVELS:
        raise RequestError(f"log_level must be one of {', '.join(LOG_LEVELS)}")


def check_batching(batching: Batching, config: EngineConfig, held_bytes: int) -> None:
    """Refuse T2 values out of bounds, a prefill chunk larger than a forward's rows (with
    the values it would run with), and a KV budget below the ``held_bytes`` the node's
    sessions hold now (it would have to drop KV it promised to keep)."""
    _bounded("max_batch_tokens", batching.max_batch_tokens, 1, MAX_BATCH_TOKENS)
    _bounded("prefill_chunk", batching.prefill_chunk, 1, MAX_BATCH_TOKENS)
    _bounded("kv_budget_bytes", batching.kv_budget_bytes, 0, MAX_KV_BUDGET_BYTES)
    after = with_batching(config, batching)
    if after.prefill_chunk > after.max_batch_tokens:
        raise RequestError(
            f"prefill_chunk {after.prefill_chunk} is larger than max_batch_tokens "
            f"{after.max_batch_tokens}: one forward could not hold one chunk"
        )
    budget = batching.kv_budget_bytes
    if budget and budget < held_bytes:
        raise RequestError(
            f"kv_budget_bytes {budget} is below the {held_bytes} bytes of KV the node's "
            "sessions hold now: park, evict or end sessions first"
        )


def with_limits(config: EngineConfig, limits: Limits) -> EngineConfig:
    """``config`` with the T1 values set (the log level is not the engine's)."""
    return replace(
        config,
        max_streams=_or(limits.max_streams, config.max_streams),
        max_queued_steps=_or(limits.max_queued_steps, config.max_queued_steps),
    )


def with_batching(config: EngineConfig, batching: Batching) -> EngineConfig:
    """``config`` with the T2 values set."""
    return replace(
        config,
        max_batch_tokens=_or(batching.max_batch_tokens, config.max_batch_tokens),
        prefill_chunk=_or(batching.prefill_chunk, config.prefill_chunk),
        kv_budget_bytes=_or(batching.kv_budget_bytes, config.kv_budget_bytes),
    )


def set_log_level(level: str | None) -> None:
    """Set the process's log level (the root logger's), when one is given."""
    if level is not None:
        logging.getLogger().setLevel(level)


def settings(config: EngineConfig) -> pb.NodeSettings:
    """What the node runs with now, for a ``ConfigureResponse``."""
    return pb.NodeSettings(
        max_streams=config.max_streams,
        max_queued_steps=config.max_queued_steps,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        max_batch_tokens=config.max_batch_tokens,
        prefill_chunk=config.prefill_chunk,
        kv_budget_bytes=config.kv_budget_bytes,
    )


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
            self._engine.configure_limits(change).result(CONTROL_TIMEOUT_S)
            return self._answer(change, True, "limits applied")
        if isinstance(change, Batching):
            check_batching(change, self._engine.config, self._engine.stats().kv_bytes)
            if check:
                return self._answer(change, False, "checked: the batching can be applied")
            self._drained(self._engine.configure_batching(change))
            return self._answer(change, True, "batching applied at a step boundary")
        if isinstance(change, Unload):
            return self._unload(change, check)
        return self._load(change, check)

    def _unload(self, change: Unload, check: bool) -> pb.ConfigureResponse:
        if check:
            return self._answer(change, False, "checked: the node can be emptied")
        ended = self._drained(self._engine.swap(None))
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
        settle()  # and the memory they held goes back to the system
        ended = self._drained(self._engine.swap(shard))
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


def _bounded(name: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], not {value}")


def _or(value: int | None, current: int) -> int:
    return current if value is None else value
