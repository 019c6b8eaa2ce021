"""Generation over a local chain: batched prefill, then batched decode steps.

Several requests run together: their prompts share one prefill forward and
every decode step advances all unfinished requests in one forward. Each
request samples with its own seeded ``Sampler``, so its tokens are the ones
it gets alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.engine.chain import ChainKV, ShardChain
from meshnet.engine.request import FinishReason, RequestState, check_request
from meshnet.model.sampling import SamplingParams
from meshnet.model.tokenizer import TextTokenizer

# Called with (request index, newly final text) as tokens are generated.
TextCallback = Callable[[int, str], None]


@dataclass(frozen=True)
class Generation:
    """The outcome of one request."""

    prompt_ids: list[int]
    ids: list[int]  # generated ids, the eos id included when generation stopped on it
    text: str  # generated text, without the eos and cut before a stop string
    finish_reason: FinishReason
    prefill_s: float  # wall time of the prefill forward this request took part in
    decode_s: float  # wall time of the decode steps it took part in


@dataclass
class _Running:
    state: RequestState
    kv: ChainKV
    prefill_s: float = 0.0
    decode_s: float = 0.0


def generate(
    chain: ShardChain,
    tokenizer: TextTokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    on_text: TextCallback | None = None,
) -> Generation:
    """Generate for one prompt."""
    return generate_batch(chain, tokenizer, [(prompt_ids, params)], on_text)[0]


def generate_batch(
    chain: ShardChain,
    tokenizer: TextTokenizer,
    requests: Sequence[tuple[Sequence[int], SamplingParams]],
    on_text: TextCallback | None = None,
) -> list[Generation]:
    """Generate for several prompts at once; results in request order."""
    for prompt, params in requests:
        check_request(chain.spec, prompt, params)
    runs = [_Running(RequestState(p, sp, tokenizer), chain.new_sequence()) for p, sp in requests]
    t0 = time.perf_counter()
    logits = chain.forward(
        np.concatenate([np.asarray(r.state.prompt_ids, dtype=np.int64) for r in runs]),
        [r.kv for r in runs],
        [len(r.state.prompt_ids) for r in runs],
    )
    for i, r in enumerate(runs):
        _take(i, r, logits[i], on_text)
    elapsed = time.perf_counter() - t0
    for r in runs:
        r.prefill_s = elapsed
    while active := [(i, r) for i, r in enumerate(runs) if not r.state.done]:
        t0 = time.perf_counter()
        logits = chain.forward(
            np.asarray([r.state.ids[-1] for _, r in active], dtype=np.int64),
            [r.kv for _, r in active],
            [1] * len(active),
        )
        for row, (i, r) in enumerate(active):
            _take(i, r, logits[row], on_text)
        elapsed = time.perf_counter() - t0
        for _, r in active:
            r.decode_s += elapsed
    return [_result(r) for r in runs]


def _take(index: int, r: _Running, logits: np.ndarray, on_text: TextCallback | None) -> None:
    delta = r.state.take(logits)
    if delta and on_text:
        on_text(index, delta)
    if r.state.done:
        r.kv.clear()  # drop this request's caches now, not when the batch ends


def _result(r: _Running) -> Generation:
    s = r.state
    finish: FinishReason = s.finish or "length"  # always set: the loop runs until it is
    return Generation(s.prompt_ids, s.ids, s.text, finish, r.prefill_s, r.decode_s)
