"""Engine throughput: prefill of one prompt, and decode at several batch sizes.

Decode drives the chain directly with greedy picks and no eos stop, so every
step carries the full batch; the figure is aggregate tokens per second.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.engine.local import LocalModel

# Plain English that tokenizes to far more tokens than any benchmark prompt needs.
_FILLER = (
    "The history of computing is a story of people finding ways to make machines do "
    "arithmetic faster, store more, and talk to one another. Early mechanical "
    "calculators gave way to relays and vacuum tubes, then to transistors and "
    "integrated circuits, each step shrinking the cost of a single operation. "
    "Networks grew from a handful of university machines into a web that spans the "
    "planet, and with them came new problems: how to share work fairly, how to "
    "recover when a part fails, and how to trust results computed by strangers. "
)


@dataclass(frozen=True)
class EngineFigures:
    prefill_tok_s: float  # one prompt of ``prompt_tokens`` tokens, best of several runs
    decode_tok_s: dict[int, float]  # batch size -> aggregate decode tokens/s, best of several


def bench_prompt(model: LocalModel, n_tokens: int, offset: int = 0) -> list[int]:
    """``n_tokens`` ids of filler text, starting ``offset`` tokens in."""
    ids = model.tokenizer.encode(_FILLER * (1 + (n_tokens + offset) // 60))
    return ids[offset : offset + n_tokens]


def bench_engine(
    model: LocalModel,
    prompt_tokens: int = 100,
    decode_tokens: int = 32,
    batches: Sequence[int] = (1, 8, 32),
    repeats: int = 3,
) -> EngineFigures:
    """Measure prefill and decode throughput of ``model``'s chain."""
    return EngineFigures(
        prefill_tok_s=_prefill(model, prompt_tokens, repeats),
        decode_tok_s={
            b: max(_decode(model, b, decode_tokens) for _ in range(repeats)) for b in batches
        },
    )


def _prefill(model: LocalModel, n_tokens: int, repeats: int) -> float:
    ids = np.asarray(bench_prompt(model, n_tokens), dtype=np.int64)
    best = float("inf")
    for _ in range(repeats):
        kv = model.chain.new_sequence()
        t0 = time.perf_counter()
        model.chain.forward(ids, [kv], [len(ids)])
        best = min(best, time.perf_counter() - t0)
    return n_tokens / best


def _decode(model: LocalModel, batch: int, steps: int) -> float:
    chain = model.chain
    prompts = [bench_prompt(model, 16, offset=7 * i) for i in range(batch)]
    seqs = [chain.new_sequence() for _ in range(batch)]
    logits = chain.forward(np.concatenate(prompts), seqs, [len(p) for p in prompts])
    t0 = time.perf_counter()
    for _ in range(steps):
        next_ids = np.argmax(logits, axis=-1)  # [batch]
        logits = chain.forward(next_ids, seqs, [1] * batch)
    return batch * steps / (time.perf_counter() - t0)
