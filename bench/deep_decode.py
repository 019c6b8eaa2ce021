"""A decode step's attention deep in a context: the native kernel against the read bandwidth.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/deep_decode.py [--against OLD.so] \\
        [--depths 4096,16384,32768] [--threads 2]

One row (a decode step) attends over a cache of ``depth`` positions in two global-attention
shapes: Gemma 3 270M's (4 query heads of 256 over one KV head) and Llama 3.2 1B's (32 of 64
over 8). Seeded random float32 keys and values, as a node keeps them; three layers' caches
taken in turn, with a buffer larger than the last-level cache read between calls, so every
call reads its keys and values from memory, as a step through a model's layers does.

Printed per shape and depth: milliseconds a call (wall, the median of ``--rounds``), the GB/s
of keys and values it read, and that rate as a share of the machine's streaming read
bandwidth for as many threads over a buffer of at least 256 MB, probed in the same run
(benchmark/bandwidth.py's numpy sum: the limit a memory-bound step cannot pass). With
``--against``, another build of the extension (the old kernels) takes turns with this tree's,
and new / old and whether their outputs are the same bits are printed.

The figures are wall time of memory-bound calls, so other processes' load spoils them: each
round waits for idle CPUs first (benchmark/quiet.py) and a disturbed round is taken again;
a figure with no undisturbed round is marked ``*``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from meshnet.backends import _native
from meshnet.benchmark.bandwidth import read_gb_s
from meshnet.benchmark.native_build import load_build
from meshnet.benchmark.quiet import Quiet

SHAPES = {  # name: (query heads, KV heads, head dim)
    "Gemma-3-270M global": (4, 1, 256),
    "Llama-3.2-1B": (32, 8, 64),
}
LAYERS = 3
PASSES = 8  # over the layers a measurement: one call is a few ms, and memory's pace wavers
EVICT_MB = 64  # read between calls: more than this host's 32 MB last-level cache
PROBE_MB = 256  # the bandwidth probe's least buffer: from memory, not from the caches


class Case:
    """One shape at one depth: its layers' caches, a query, and a call of one build."""

    def __init__(self, heads: int, kv: int, hd: int, depth: int) -> None:
        rng = np.random.default_rng(0)
        self.shape, self.depth = (heads, kv, hd), depth
        room = depth + 64  # the new position's slot, as a grown cache has
        self.layers = [
            tuple(rng.standard_normal((kv, room, hd)).astype(np.float32) for _ in range(2))
            for _ in range(LAYERS)
        ]
        self.q = rng.standard_normal((1, heads * hd)).astype(np.float32)
        self.kv_row = rng.standard_normal((1, kv * hd)).astype(np.float32)
        self.evict = np.ones((EVICT_MB << 20) // 8, np.uint64)

    @property
    def read_bytes(self) -> int:
        """Keys and values one call reads: every position's of every KV head."""
        _, kv, hd = self.shape
        return 2 * kv * (self.depth + 1) * hd * 4

    def seconds(self, build: ModuleType, threads: int) -> tuple[float, np.ndarray]:
        """Wall seconds a call, the mean over ``PASSES`` passes over the layers, each call
        after the eviction read; the output."""
        heads, kv, hd = self.shape
        out = np.empty((1, heads * hd), np.float32)
        total = 0.0
        for keys, values in self.layers * PASSES:
            self.evict.sum()
            entry = [(keys, values, self.depth, 1, 0)]
            start = time.perf_counter()
            build.attend(
                self.q, self.kv_row, self.kv_row, out, entry, 1, heads, kv, hd, threads,
                hd**-0.5, 0.0, 0,
            )  # fmt: skip
            total += time.perf_counter() - start
        return total / (LAYERS * PASSES), out


def bench(builds: dict[str, ModuleType], args: argparse.Namespace, quiet: Quiet) -> None:
    for name, (heads, kv, hd) in SHAPES.items():
        for depth in args.depths:
            case = Case(heads, kv, hd, depth)
            probe = read_gb_s(max(PROBE_MB, case.read_bytes >> 20), passes=5, threads=args.threads)
            times: dict[str, list[float]] = {b: [] for b in builds}
            calm = {b: False for b in builds}
            outs: dict[str, np.ndarray] = {}
            for b, module in builds.items():  # warm up: page in, load the code
                outs[b] = case.seconds(module, args.threads)[1].copy()
            for _ in range(args.rounds):
                for b, module in builds.items():
                    tries = quiet.tries(lambda c=case, m=module: c.seconds(m, args.threads)[0])
                    seconds, others = min(tries, key=lambda t: t[1])
                    times[b].append(seconds)
                    calm[b] = calm[b] or others <= quiet.threshold
            new = statistics.median(times["new"])
            rate = case.read_bytes / new / 1e9
            mark = "" if calm["new"] else "*"
            line = (
                f"{name}, depth {depth}: new {new * 1e3:.2f}{mark} ms, {rate:.1f} GB/s, "
                f"{rate / probe:.0%} of the {probe:.1f} GB/s read bandwidth"
            )
            if "old" in builds:
                old = statistics.median(times["old"])
                same = np.array_equal(outs["new"], outs["old"])
                line += f"; old {old * 1e3:.2f} ms, new/old {old / new:.2f}x"
                line += f", same bits: {'yes' if same else 'NO'}"
            print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", type=Path, help="another build of _native (.so) to compare")
    p.add_argument("--depths", default="4096,16384,32768", help="positions in the cache")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quiet-wait", type=float, default=20.0, help="seconds to wait for idle CPUs")
    args = p.parse_args()
    args.depths = [int(d) for d in args.depths.split(",")]
    builds: dict[str, ModuleType] = {"new": _native}
    if args.against is not None:
        builds["old"] = load_build(args.against)
    print(f"isa {_native.isa()}, {args.threads} threads", flush=True)
    bench(builds, args, Quiet(max_wait_s=args.quiet_wait))


if __name__ == "__main__":
    main()
