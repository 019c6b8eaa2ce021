"""Prefill at long context: the native attention alone, and optionally a whole model.

    OPENBLAS_NUM_THREADS=2 .venv/bin/python bench/long_prefill.py --against OLD.so \\
        [--model ~/.cache/meshnet/models/gemma3-270m-synthetic-s0-Q4_K_M.gguf \\
         --prompt-tokens 8192]

(the model file: ``scripts/make_synthetic_model.py --family gemma3``, or a real Gemma 3 GGUF)

The attention (``_native.attend``) in Gemma 3 270M's shape (4 query heads of 256, one KV
head) over one prompt of ``--tokens`` rows, seeded random q, k, v: a global layer in one
call, the same as a node feeds it (calls of ``--chunk`` rows), and a sliding-window
layer (``--window``). Each is timed for this tree's build and, with ``--against``,
another build of the extension (the old kernels), taking turns in the same run; every
figure is CPU time of the process (time.process_time: other processes' load on the
shared machine does not count, the kernels' own threads do), the median of
``--rounds``, printed as GMAC/s (the multiply-adds of the scores and weighted sums of
the positions each row sees, per CPU second) and new / old. The two builds' outputs are
compared bit for bit (a row's result may not depend on how its work is scheduled).

The q8 matmuls of a long prompt's rows (Gemma 3 270M's Q5_0 gate, 2048x640, and its
Q6_K down, 640x2048; seeded random blocks) over ``--tokens`` rows in one call, the same
way: wall and CPU seconds per call (medians), new / old, and the bits compared.

With ``--model``, the whole prefill of ``--prompt-tokens`` of that GGUF in one forward
(as ``meshnet bench``), backend q8, each build's model loaded once, runs taking turns:
wall seconds and CPU seconds, medians, new / old.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.backends import _native, quant
from meshnet.benchmark.native_build import load_build

HEADS, KV, HD = 4, 1, 256


def attention_case(
    build: ModuleType, tokens: int, chunk: int, window: int, threads: int
) -> Callable[[], np.ndarray]:
    """A call of every chunk of one prompt's attention, fresh cache each time; its output."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((tokens, HEADS * HD)).astype(np.float32)
    k = rng.standard_normal((tokens, KV * HD)).astype(np.float32)
    v = rng.standard_normal((tokens, KV * HD)).astype(np.float32)
    out = np.empty((tokens, HEADS * HD), np.float32)
    keys = np.zeros((KV, tokens, HD), np.float32)
    values = np.zeros_like(keys)

    def run() -> np.ndarray:
        for first in range(0, tokens, chunk):
            n = min(chunk, tokens - first)
            rows = slice(first, first + n)
            entry = [(keys, values, first, n, 0)]
            build.attend(
                q[rows], k[rows], v[rows], out[rows], entry, n, HEADS, KV, HD, threads,
                HD**-0.5, 0.0, window,
            )  # fmt: skip
        return out

    return run


def macs(tokens: int, window: int) -> float:
    """Multiply-adds of the scores and weighted sums of every row's visible positions."""
    seen = np.minimum(np.arange(1, tokens + 1), window if window > 0 else tokens)
    return float(seen.sum()) * HEADS * HD * 2


def bench_attention(builds: dict[str, ModuleType], args: argparse.Namespace) -> None:
    cases = {
        f"global, {args.tokens} rows in one call": (args.tokens, 0),
        f"global, {args.tokens} rows in calls of {args.chunk}": (args.chunk, 0),
        f"window {args.window}, {args.tokens} rows in one call": (args.tokens, args.window),
    }
    for name, (chunk, window) in cases.items():
        runs = {
            b: attention_case(m, args.tokens, chunk, window, args.threads)
            for b, m in builds.items()
        }
        outs = {b: run().copy() for b, run in runs.items()}  # warm up, and the bits
        rates: dict[str, list[float]] = {b: [] for b in builds}
        for _ in range(args.rounds):
            for b, run in runs.items():
                start = time.process_time()
                run()
                rates[b].append(macs(args.tokens, window) / (time.process_time() - start) / 1e9)
        line = f"{name}: new {statistics.median(rates['new']):.1f} GMAC/s"
        if "old" in builds:
            old = statistics.median(rates["old"])
            same = np.array_equal(outs["new"], outs["old"])
            line += f", old {old:.1f}, new/old {statistics.median(rates['new']) / old:.2f}x"
            line += f", same bits: {'yes' if same else 'NO'}"
        print(line, flush=True)


def random_q8(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> quant.QuantMatrix:
    """A ``rows`` x ``cols`` matrix of random quants and small float16 scales, q8 layout."""
    size, per, scale_at = {QT.Q5_0: (22, 32, 0), QT.Q6_K: (210, 256, 208)}[qtype]
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    raw[:, scale_at : scale_at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return quant.from_blocks(raw.reshape(-1), qtype, (rows, cols), q8=True)


def bench_matmul(builds: dict[str, ModuleType], args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    for name, qtype, rows, cols in (
        ("Q5_0 2048x640", QT.Q5_0, 2048, 640),
        ("Q6_K 640x2048", QT.Q6_K, 640, 2048),
    ):
        packed, _, nb, code = quant.native_args(random_q8(qtype, rows, cols, rng))
        x = rng.standard_normal((args.tokens, cols)).astype(np.float32)
        outs = {b: np.empty((args.tokens, rows), np.float32) for b in builds}
        wall: dict[str, list[float]] = {b: [] for b in builds}
        cpu: dict[str, list[float]] = {b: [] for b in builds}
        for r in range(args.rounds * 3 + 1):
            for b, m in builds.items():
                w0, c0 = time.perf_counter(), time.process_time()
                m.matmul(packed, x, outs[b], rows, nb, args.tokens, code, args.threads, True)
                if r > 0:  # the first round warms up
                    wall[b].append(time.perf_counter() - w0)
                    cpu[b].append(time.process_time() - c0)
        w, c = statistics.median(wall["new"]), statistics.median(cpu["new"])
        line = f"q8 matmul {name}, {args.tokens} rows: new {w * 1e3:.0f} ms wall, {c * 1e3:.0f} CPU"
        if "old" in builds:
            wo, co = statistics.median(wall["old"]), statistics.median(cpu["old"])
            same = np.array_equal(outs["new"], outs["old"])
            line += f"; old {wo * 1e3:.0f}, {co * 1e3:.0f}; new/old {wo / w:.2f}x wall"
            line += f", {co / c:.2f}x CPU; same bits: {'yes' if same else 'NO'}"
        print(line, flush=True)


def bench_model(builds: dict[str, ModuleType], args: argparse.Namespace) -> None:
    from meshnet.backends.kernel_threads import set_threads
    from meshnet.benchmark.engine import bench_prompt
    from meshnet.engine.local import LocalModel, load_local_model

    set_threads(args.threads)
    models: dict[str, LocalModel] = {}
    for b, module in builds.items():  # each model's blocks are handles of its own build
        quant.NATIVE = module
        models[b] = load_local_model(args.model, backend="q8")
    ids = np.asarray(bench_prompt(models["new"], args.prompt_tokens), dtype=np.int64)
    wall: dict[str, list[float]] = {b: [] for b in builds}
    cpu: dict[str, list[float]] = {b: [] for b in builds}
    logits: dict[str, np.ndarray] = {}
    for _ in range(args.model_rounds):
        for b, model in models.items():
            quant.NATIVE = builds[b]
            kv = model.chain.new_sequence()
            w0, c0 = time.perf_counter(), time.process_time()
            logits[b] = model.chain.forward(ids, [kv], [len(ids)])
            wall[b].append(time.perf_counter() - w0)
            cpu[b].append(time.process_time() - c0)
            del kv
    quant.NATIVE = builds["new"]
    for b in builds:
        w, c = statistics.median(wall[b]), statistics.median(cpu[b])
        rate = args.prompt_tokens / w
        print(
            f"prefill {args.prompt_tokens} ({b}): {w:.2f} s wall, {rate:.1f} tok/s; {c:.2f} CPU s"
        )
    if "old" in builds:
        w = statistics.median(wall["old"]) / statistics.median(wall["new"])
        c = statistics.median(cpu["old"]) / statistics.median(cpu["new"])
        same = np.array_equal(logits["new"], logits["old"])
        print(f"new/old speed: {w:.2f}x wall, {c:.2f}x CPU; same logits: {'yes' if same else 'NO'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", type=Path, help="another build of _native (.so) to compare")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=128, help="rows a call, as a node's prefill_chunk")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", type=Path, help="a GGUF: also time its whole prefill")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--model-rounds", type=int, default=3)
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-matmul", action="store_true")
    args = p.parse_args()
    builds: dict[str, ModuleType] = {"new": _native}
    if args.against is not None:
        builds["old"] = load_build(args.against)
    print(f"isa {_native.isa()}, {args.threads} threads", flush=True)
    if not args.skip_attention:
        bench_attention(builds, args)
    if not args.skip_matmul:
        bench_matmul(builds, args)
    if args.model is not None:
        bench_model(builds, args)


if __name__ == "__main__":
    main()
