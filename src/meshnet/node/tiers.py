"""The three tiers of a node's live configuration, as values, checked in pure functions
(docs/design.md §11).

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

Every value is checked here before the engine is asked to change; a refused
change raises ``RequestError`` with the reason and changes nothing. The engine
applies a change on its loop (node/engine_tiers.py); ``Configurator``
(node/configure.py) answers the ``Configure`` call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from meshnet.errors import MalformedBundle, RequestError
from meshnet.layer_range import LayerRange
from meshnet.node.engine_types import EngineConfig
from meshnet.protocol import meshnet_pb2 as pb

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
        load = request.load
        if not load.model_path and load.layer_start == 0 and load.layer_end == 0:
            return Unload()
        path = load.model_path or start_model
        if not path:
            raise RequestError("no model path given and none configured at start")
        return ShardLoad(path, LayerRange(load.layer_start, load.layer_end))
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


def _bounded(name: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], not {value}")


def _or(value: int | None, current: int) -> int:
    return current if value is None else value
