"""KV memory of sessions that share a system prompt: pages shared vs a copy each (issue 34).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/prefix_memory.py [--clients 8]

A node's engine (in this process's child, one per side, so each side's memory is its
own) on the bundled model (or ``--model``), backend q8, ``--threads``; ``--clients``
sessions open one after another, each on the same ~``--system-tokens`` system prompt
and a question of its own, and stay open. With the prefix cache on, the first computes
the prompt and the rest start with it from the cache: the pages of it are read in
place by all of them (kv/pages.py). With it off, each computes and holds its own.

Printed per side: the KV the sessions hold as the node's budget counts it (each shared
page once), the prefix cache's bytes, the process's resident memory grown by the
sessions (the truth the counts stand for), and the mean seconds from open to a
session's prompt computed (its first token's wait), clients 2 on. Then on / off for
each: the memory the sessions take with shared pages against a copy each.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshnet.backends.kernel_threads import set_threads
from meshnet.benchmark.prefix_ttft import system_prompt
from meshnet.layer_range import LayerRange
from meshnet.model.bundled import bundled_model_path
from meshnet.model.info import load_model_info
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.prefixes import PrefixAsk
from meshnet.node.scheduler import StepWork


@dataclass(frozen=True)
class Side:
    kv_bytes: int  # the sessions' KV as the budget counts it
    cache_bytes: int  # the prefix cache's
    rss_bytes: int  # resident memory the sessions added
    prompt_s: list[float]  # open to prompt computed, per client
    last_logits: bytes  # the last client's, to check both sides agree


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _side(model: str, prompts: list[np.ndarray], cache_mb: int, threads: int) -> Side:
    set_threads(threads)
    info = load_model_info(Path(model))
    engine = NodeEngine(EngineConfig(prefix_cache_bytes=cache_mb << 20))
    engine.start()
    try:
        engine.tiers.load(model, LayerRange(0, info.spec.n_layers)).result(timeout=600)
        gc.collect()
        before = _rss()
        waits: list[float] = []
        logits = np.empty(0)
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            sid = f"client-{i}"
            opened = engine.sessions.open(sid, 1, prefix=PrefixAsk(ids, len(ids) - 1)).result(60)
            rest = ids[opened.kv_tokens :]
            work = StepWork(sid, 1, rest, None, step=opened.steps)
            logits = engine.submit(work).result(600)
            waits.append(time.perf_counter() - t0)
        gc.collect()
        stats = engine.stats()
        cached = stats.prefix.nbytes if stats.prefix is not None else 0
        return Side(stats.kv_bytes, cached, _rss() - before, waits, np.asarray(logits).tobytes())
    finally:
        engine.stop()


def _run(model: str, prompts: list[np.ndarray], cache_mb: int, threads: int) -> Side:
    """One side in a child process of its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_side, (model, prompts, cache_mb, threads))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the bundled model)")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-mb", type=int, default=1024, help="the prefix cache's size, on")
    args = p.parse_args()
    model = str(args.model or bundled_model_path())
    tokenizer = load_model_info(Path(model)).tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    prompts = [
        np.asarray(tokenizer.encode(f"{system}Question {i}: where is my order number {i}?"))
        for i in range(args.clients)
    ]
    shared = len(tokenizer.encode(system))
    print(f"{args.clients} sessions on one {shared}-token system prompt, {model}")
    sides = {"on": _run(model, prompts, args.cache_mb, args.threads)}
    sides["off"] = _run(model, prompts, 0, args.threads)
    mb = 1 / 2**20
    for name, s in sides.items():
        wait = statistics.fmean(s.prompt_s[1:]) if len(s.prompt_s) > 1 else s.prompt_s[0]
        print(
            f"prefix cache {name:3s}: sessions' KV {s.kv_bytes * mb:8.1f} MB, cache "
            f"{s.cache_bytes * mb:7.1f} MB, resident +{s.rss_bytes * mb:8.1f} MB, "
            f"prompt computed in {wait:6.3f} s (clients 2 on; the first {s.prompt_s[0]:.3f} s)"
        )
    on, off = sides["on"], sides["off"]
    if on.last_logits != off.last_logits:
        print("MISMATCH: the last client's logits differ with the cache on")
    print(f"\nsessions' KV, on / off: {on.kv_bytes / off.kv_bytes:.3f}x")
    print(f"resident memory added, on / off: {on.rss_bytes / off.rss_bytes:.3f}x")
    waits_on, waits_off = on.prompt_s[1:] or on.prompt_s, off.prompt_s[1:] or off.prompt_s
    print(f"prompt wait, on / off: {statistics.fmean(waits_on) / statistics.fmean(waits_off):.3f}x")


if __name__ == "__main__":
    main()
