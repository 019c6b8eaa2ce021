"""A step's input as it reaches a hop, checked before the engine sees any of it.

An input comes in its ``Step`` message, in a ``RelayStream`` frame, or off the
relay port as an array; each is held to the same limits (dtype, rank, rows up to
a context, the model's width, finite values, token ids in the vocabulary) and
refused with ``MalformedBundle`` otherwise. So are the history the penalties
look at and an Open's logit bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import numpy as np

from meshnet.backends.shard import Shard
from meshnet.errors import MalformedBundle
from meshnet.model.penalties import MAX_LOGIT_BIAS
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb


def tensor_input(shard: Shard, tensor: pb.Tensor) -> np.ndarray:
    """A step's input as sent or relayed, checked: token ids for the first layer (the
    first hop of a ring is relayed the last hop's token), hidden states for the others."""
    return _ids_checked(shard, codec.decode(tensor, _input_limits(shard)))


def array_input(shard: Shard, x: np.ndarray) -> np.ndarray:
    """``tensor_input`` of an input the relay port read as an array."""
    return _ids_checked(shard, codec.checked(x, _input_limits(shard)))


def _input_limits(shard: Shard) -> codec.TensorLimits:
    return _limits(shard.is_first, shard.spec.context_length, shard.spec.d_model)


@cache
def _limits(first: bool, context_length: int, d_model: int) -> codec.TensorLimits:
    """A hop's input limits, made once: a dataclass made afresh took ~20 us of every
    ring hop on a cold core."""
    if first:
        return codec.TensorLimits("i64", 1, context_length)
    return codec.TensorLimits("f32", 2, context_length, d_model)


def _ids_checked(shard: Shard, x: np.ndarray) -> np.ndarray:
    """``x``, unless it holds a token id outside the vocabulary (on the first hop)."""
    if shard.is_first:
        low, high = (int(x[0]), int(x[0])) if len(x) == 1 else (int(x.min()), int(x.max()))
        if low < 0 or high >= shard.spec.vocab_size:
            raise MalformedBundle(f"token ids must be in [0, {shard.spec.vocab_size})")
    return x


def rows_checked(step: pb.Step, x: np.ndarray) -> np.ndarray:
    """``x``, unless it has other than the rows ``step`` says were relayed."""
    if x.shape[0] != step.rows:
        raise MalformedBundle(f"the previous hop relayed {x.shape[0]} rows, not {step.rows}")
    return x


def step_history(step: pb.Step, context_length: int, vocab_size: int) -> list[int]:
    """The ids a repetition penalty looks at, checked: at most a context, all in the vocabulary."""
    ids = list(step.history)
    if len(ids) > context_length:
        raise MalformedBundle(f"a history of {len(ids)} ids is longer than the context")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise MalformedBundle(f"history ids must be in [0, {vocab_size})")
    return ids


def logit_bias(entries: Mapping[int, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """An Open's logit bias as the sampler takes it (ids ascending), checked: at most
    ``MAX_LOGIT_BIAS`` ids, all in the vocabulary (values are checked by the sampler's
    parameters)."""
    if len(entries) > MAX_LOGIT_BIAS:
        raise MalformedBundle(f"a logit bias of {len(entries)} ids, at most {MAX_LOGIT_BIAS}")
    if any(token >= vocab_size for token in entries):
        raise MalformedBundle(f"logit bias ids must be in [0, {vocab_size})")
    return tuple(sorted((int(t), float(v)) for t, v in entries.items()))
