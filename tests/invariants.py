"""Golden invariants of the engine, shared by the tiny-model and bundled-model tests.

split == unsplit, cached decode == full recompute, batched == alone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from meshnet.engine.chain import ShardChain
from meshnet.engine.generate import generate, generate_batch
from meshnet.engine.local import LocalModel
from meshnet.model.sampling import SamplingParams


def step_logits(chain: ShardChain, prompt: Sequence[int], follow: Sequence[int]) -> np.ndarray:
    """Logits after the prompt, then after each of ``follow`` fed one at a time (cached)."""
    kv = chain.new_sequence()
    rows = [chain.forward(np.asarray(prompt), [kv], [len(prompt)])[0]]
    for token in follow:
        rows.append(chain.forward(np.asarray([token]), [kv], [1])[0])
    return np.stack(rows)  # [1 + len(follow), vocab]


def greedy_logits(
    chain: ShardChain, prompt: Sequence[int], steps: int, eog: Collection[int]
) -> tuple[list[int], np.ndarray]:
    """A greedy run's ids (up to ``steps``, or an end-of-generation id) and the logits each
    was picked from: ``step_logits`` of those ids, in one pass."""
    kv = chain.new_sequence()
    rows = [chain.forward(np.asarray(prompt), [kv], [len(prompt)])[0]]
    ids = [int(np.argmax(rows[-1]))]
    while len(ids) < steps and ids[-1] not in eog:
        rows.append(chain.forward(np.asarray([ids[-1]]), [kv], [1])[0])
        ids.append(int(np.argmax(rows[-1])))
    return ids, np.stack(rows)


def recomputed_logits(
    chain: ShardChain, prompt: Sequence[int], follow: Sequence[int]
) -> np.ndarray:
    """The same logits from one uncached forward over the whole sequence."""
    ids = np.asarray([*prompt, *follow])
    kv = chain.new_sequence()
    every = chain.forward(ids, [kv], [len(ids)], logits="all")
    return every[len(prompt) - 1 :]


def assert_split_batched_chunked_identical(
    whole: ShardChain, split: ShardChain, prompt: Sequence[int], follow: Sequence[int]
) -> None:
    """A sequence's logits are bit-identical split over shards, recomputed uncached, its
    prompt in chunks of 5, and batched beside another sequence (prompt and decode rows in
    one forward)."""
    cached = step_logits(whole, prompt, follow)
    assert np.array_equal(cached, step_logits(split, prompt, follow))
    assert np.array_equal(cached, recomputed_logits(whole, prompt, follow))
    kv = whole.new_sequence()
    for start in range(0, len(prompt), 5):
        piece = prompt[start : start + 5]
        last = whole.forward(np.asarray(piece), [kv], [len(piece)])[0]
    assert np.array_equal(last, cached[0])
    other, mine = whole.new_sequence(), whole.new_sequence()
    both = whole.forward(np.asarray([*prompt[:7], *prompt]), [other, mine], [7, len(prompt)])
    assert np.array_equal(both[1], cached[0])
    for i, token in enumerate(follow):
        both = whole.forward(np.asarray([3 + i, token]), [other, mine], [1, 1])
        assert np.array_equal(both[1], cached[i + 1])


def banned_greedy(
    chain: ShardChain, recorded: Mapping[str, Any]
) -> tuple[list[int], list[np.ndarray]]:
    """As many greedy ids as a recorded llama.cpp oracle has steps, from its prompt, over
    the vocabulary less its banned ids, and each step's log-probs over the whole."""
    prompt, banned = recorded["prompt_ids"], recorded["banned_ids"]
    kv = chain.new_sequence()
    logits = chain.forward(np.asarray(prompt), [kv], [len(prompt)])[0]
    ids, logprobs = [], []
    for _ in recorded["steps"]:
        wide = logits.astype(np.float64)
        top = wide.max()
        logprobs.append(wide - (top + np.log(np.exp(wide - top).sum())))
        wide[np.asarray(banned)] = -np.inf
        ids.append(int(np.argmax(wide)))
        logits = chain.forward(np.asarray([ids[-1]]), [kv], [1])[0]
    return ids, logprobs


def solo_and_batched_ids(
    model: LocalModel, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> tuple[list, list]:
    solo = [
        generate(model.chain, model.tokenizer, p, sp).ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    batched = generate_batch(model.chain, model.tokenizer, list(zip(prompts, params, strict=True)))
    return solo, [g.ids for g in batched]
