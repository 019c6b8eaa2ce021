"""Engine throughput: prefill of one prompt, and decode at several batch sizes.

Decode drives the chain directly with greedy picks and no eos stop, so every
step carries the full batch; the figure is aggregate tokens per second.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from meshnet.backends.quant import kernel_name
from meshnet.benchmark.figures import Throughput
from meshnet.engine.chain import ChainKV
from meshnet.engine.local import LocalModel
from meshnet.kv.cache import SequenceKV

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


def backend_text(backend: str) -> str:
    """Which of our backends a benchmark ran, and on which kernels, for its report."""
    return backend if backend == "numpy" else f"{backend} ({kernel_name()} kernels)"


def prefilled_kv(kv_heads: int, head_dim: int, positions: int, chunk: int = 512) -> SequenceKV:
    """One layer's cache of ``positions`` seeded random positions, grown chunk by chunk as a
    node's prefill grows it (so its arrays lie on the pages a node's would)."""
    rng = np.random.default_rng(0)
    cache = SequenceKV(1, kv_heads, head_dim)
    for start in range(0, positions, chunk):
        n = min(chunk, positions - start)
        cache.reserve(n)
        cache.write(0, *rng.standard_normal((2, kv_heads, n, head_dim), np.float32))
        cache.advance(n)
    return cache


def bench_prompt(model: LocalModel, n_tokens: int, offset: int = 0) -> list[int]:
    """``n_tokens`` ids of filler text, starting ``offset`` tokens in."""
    ids = model.tokenizer.encode(_FILLER * (1 + (n_tokens + offset) // 60))
    return ids[offset : offset + n_tokens]


def bench_engine(
    model: LocalModel,
    prompt_tokens: int = 100,
    decode_tokens: int = 32,
    batches: Sequence[int] = (1, 8, 32),
    at_depth: bool = False,
) -> Throughput:
    """One round: prefill and decode throughput of ``model``'s chain; with ``at_depth``
    also one sequence's decode continuing from the timed prompt."""
    prefill, kv, logits = _prefill(model, prompt_tokens)
    deep = _steps(model, [kv], logits, decode_tokens) if at_depth else None
    return Throughput(
        prefill_tok_s=prefill,
        decode_tok_s={b: _decode(model, b, decode_tokens) for b in batches},
        deep_decode_tok_s=deep,
    )


def warm_up(model: LocalModel) -> None:
    """Pay first-use costs (compiling, repacking the output head) outside any round."""
    _prefill(model, 8)
    _decode(model, 2, 2)


def _prefill(model: LocalModel, n_tokens: int) -> tuple[float, ChainKV, np.ndarray]:
    """Tokens per second of one prompt, and the sequence and logits it leaves."""
    ids = np.asarray(bench_prompt(model, n_tokens), dtype=np.int64)
    kv = model.chain.new_sequence()
    t0 = time.perf_counter()
    logits = model.chain.forward(ids, [kv], [len(ids)])
    return n_tokens / (time.perf_counter() - t0), kv, logits


def _decode(model: LocalModel, batch: int, steps: int) -> float:
    chain = model.chain
    prompts = [bench_prompt(model, 16, offset=7 * i) for i in range(batch)]
    seqs = [chain.new_sequence() for _ in range(batch)]
    logits = chain.forward(np.concatenate(prompts), seqs, [len(p) for p in prompts])
    return _steps(model, seqs, logits, steps)


def _steps(model: LocalModel, seqs: list[ChainKV], logits: np.ndarray, steps: int) -> float:
    """Aggregate tokens per second of ``steps`` greedy steps of ``seqs`` from ``logits``."""
    t0 = time.perf_counter()
    for _ in range(steps):
        next_ids = np.argmax(logits, axis=-1)  # [batch]
        logits = model.chain.forward(next_ids, seqs, [1] * len(seqs))
    return len(seqs) * steps / (time.perf_counter() - t0)
