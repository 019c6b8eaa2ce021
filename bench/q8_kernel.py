"""The q8 backend's K-quant kernels at one token (a decode step's matmuls), one thread.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/q8_kernel.py [--against OLD.so]

For each shape (an expert of bench/moe.py's Qwen3-MoE, 512x1024 gate/up and 1024x512
down; 2048x768; a dense 4096x4096) and each of Q4_K, Q5_K and Q6_K, the native q8
matmul of one token is timed at both vector widths (AVX-512 VNNI and AVX2) in two
settings: ``hot``, one matrix called again and again (it stays in the caches: what the
kernel itself can do), and ``stream``, calls cycling through copies of it that together
pass ``--pool-mb``, one buffer on huge pages (each call reads its weights from memory,
as a decode step reads its experts). Weights are seeded random blocks in the GGUF
layout (the speed does not depend on their values).

Printed per row: GB/s of the weights read per call; that rate against the Q6_K
kernel's on the same shape and setting, and against a read-bandwidth probe of the
same bytes (numpy's sum over uint64 words of a buffer as large as the matrix, or the
pool, as benchmark/bandwidth.py reads); with ``--against``, the rate of another build
of the native extension (the old kernels) in the same run, and new / old.

The machine is shared: every figure is CPU time (time.process_time, one thread, so
other processes' load does not count) over calls of about ``--sample-ms`` each, the
median of ``--rounds`` rounds in which the builds and the probe take turns.
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

from meshnet.backends import quant
from meshnet.benchmark.native_build import load_build
from meshnet.memory import on_huge_pages

SHAPES = ((512, 1024), (1024, 512), (2048, 768), (4096, 4096))
TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
BLOCK_BYTES = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}
D_AT = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}  # float16 scale fields' offsets


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes of a ``rows`` x ``cols`` matrix: random quants, small float16 scales."""
    size = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for at in D_AT[qtype]:
        raw[:, at : at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(-1)


def cpu_per_call(fn: Callable[[int], object], calls: int) -> float:
    """CPU seconds per call of ``fn(i)`` for i in 0 .. calls - 1."""
    start = time.process_time()
    for i in range(calls):
        fn(i)
    return (time.process_time() - start) / calls


def matmul_fn(
    build: ModuleType, mats: list[np.ndarray], w: quant.QuantMatrix, wide: bool, tokens: int
) -> Callable[[int], object]:
    """Call i: ``tokens`` rows times mats[i % len(mats)], one thread."""
    _, rows, nb, code = quant.native_args(w)
    x = np.random.default_rng(1).standard_normal((tokens, w.cols)).astype(np.float32)
    out = np.empty((tokens, rows), np.float32)
    n = len(mats)
    return lambda i: build.matmul(mats[i % n], x, out, rows, nb, tokens, code, 1, wide)


def measure(
    builds: dict[str, ModuleType],
    qtype: QT,
    shape: tuple[int, int],
    pool_mb: int,
    rounds: int,
    sample_ms: float,
    tokens: int,
) -> dict[tuple[str, bool, str], float]:
    """GB/s per (build, wide, setting), and the probe's per setting ("probe", False, s)."""
    w = quant.from_blocks(
        random_blocks(qtype, *shape, np.random.default_rng(0)), qtype, shape, q8=True
    )
    packed = quant.native_args(w)[0]
    copies = max(1, (pool_mb << 20) // packed.nbytes)
    # one buffer on huge pages, as a model's expert tensors are (a copy each would be on
    # 4 KB pages: under 2 MB, on_huge_pages leaves it)
    pool = on_huge_pages(np.concatenate([packed.reshape(-1)] * copies))
    stream = [
        pool[i * packed.size : (i + 1) * packed.size].reshape(packed.shape) for i in range(copies)
    ]
    pools = {"hot": [packed], "stream": stream}
    fns: dict[tuple[str, bool, str], Callable[[int], object]] = {}
    for setting, mats in pools.items():
        for name, build in builds.items():
            for wide in (True, False):
                fns[(name, wide, setting)] = matmul_fn(build, mats, w, wide, tokens)
        words = np.ones(packed.nbytes * len(mats) // 8, np.uint64)
        parts = np.array_split(words, len(mats))
        fns[("probe", False, setting)] = lambda i, parts=parts: parts[i % len(parts)].sum()
    calls = {}
    for key, fn in fns.items():  # warm up, and size each sample to about sample_ms
        per = cpu_per_call(fn, 3)
        calls[key] = max(3, int(sample_ms / 1e3 / max(per, 1e-7)))
    samples: dict[tuple[str, bool, str], list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            samples[key].append(packed.nbytes / cpu_per_call(fn, calls[key]) / 1e9)
    return {key: statistics.median(v) for key, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", type=Path, help="another build of _native (.so) to compare")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sample-ms", type=float, default=60.0, help="CPU time per sample")
    p.add_argument("--pool-mb", type=int, default=256, help="stream setting's bytes (past L3)")
    p.add_argument("--tokens", type=int, default=1, help="rows of x a call (batch tiles: > 1)")
    p.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    p.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES))
    args = p.parse_args()
    if quant.NATIVE is None:
        raise SystemExit("the native extension is not built")
    builds = {"new": quant.NATIVE}
    if args.against is not None:
        builds["old"] = load_build(args.against)
    types = [QT[name] for name in args.types.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(
        f"{args.tokens} token(s) a call, one thread, CPU time, median of {args.rounds};"
        " GB/s of weights read per call"
    )
    head = f"{'shape':>10} {'type':>5} {'isa':>6} {'setting':>7} {'GB/s':>6} {'/Q6_K':>6}"
    print(head + f" {'/probe':>6}" + (f" {'old':>6} {'new/old':>7}" if "old" in builds else ""))
    for shape in shapes:
        results = {
            q: measure(builds, q, shape, args.pool_mb, args.rounds, args.sample_ms, args.tokens)
            for q in types
        }
        for qtype in types:
            for wide in (True, False):
                for setting in ("hot", "stream"):
                    print(report_line(results, qtype, shape, wide, setting), flush=True)


def report_line(
    results: dict[QT, dict[tuple[str, bool, str], float]],
    qtype: QT,
    shape: tuple[int, int],
    wide: bool,
    setting: str,
) -> str:
    """One row of the table: the new build's GB/s and its ratios."""
    r = results[qtype]
    gb = r[("new", wide, setting)]
    q6 = results[QT.Q6_K][("new", wide, setting)] if QT.Q6_K in results else float("nan")
    probe = r[("probe", False, setting)]
    name = f"{shape[0]}x{shape[1]}"
    line = f"{name:>10} {qtype.name:>5} {'avx512' if wide else 'avx2':>6} {setting:>7}"
    line += f" {gb:6.1f} {gb / q6:6.2f} {gb / probe:6.2f}"
    if ("old", wide, setting) in r:
        old = r[("old", wide, setting)]
        line += f" {old:6.1f} {gb / old:7.2f}"
    return line


if __name__ == "__main__":
    main()
