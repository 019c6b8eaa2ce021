"""A decode step's attention deep in a context: the native kernel against the read bandwidth.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/deep_decode.py [--against OLD.so] [--plain] \\
        [--shared] [--depths 4096,16384,32768] [--threads 2]

One row (a decode step) attends over a cache of ``depth`` positions in two global-attention
shapes: Gemma 3 270M's (4 query heads of 256 over one KV head) and Llama 3.2 1B's (32 of 64
over 8). Seeded random float32 keys and values, in caches a node's (``SequenceKV``, grown
as a prompt's 512-position chunks arrive, so on the pages a node's would be); three
layers' caches taken in turn, with a buffer larger than the last-level cache read between
calls, so every call reads its keys and values from memory, as a step through a model's
layers does. With ``--plain``, the same keys and values in plain numpy arrays take turns
with them, and plain / node is printed (where the cache's pages lie, 2 MB or 4 KB).
With ``--shared``, the same keys and values read as a session on a cached prefix reads
them (kv/pages.py): every whole 64 positions from a page of the prefix cache (sized for
the model's paged layers, so on the memory pages a node's would be), the rest from the
session's own arrays, and shared / node is printed.

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
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from meshnet.backends import _native
from meshnet.benchmark.bandwidth import read_gb_s
from meshnet.benchmark.engine import prefilled_kv
from meshnet.benchmark.native_build import load_build
from meshnet.benchmark.quiet import Quiet
from meshnet.kv.pages import PAGE_TOKENS, KVPage, address_table

if TYPE_CHECKING:
    from meshnet.backends._native import Entry

SHAPES = {  # name: (query heads, KV heads, head dim)
    "Gemma-3-270M global": (4, 1, 256),
    "Llama-3.2-1B": (32, 8, 64),
}
PAGED_LAYERS = {"Gemma-3-270M global": 3, "Llama-3.2-1B": 16}  # layers without a window
LAYERS = 3
PASSES = 8  # over the layers a measurement: one call is a few ms, and memory's pace wavers
EVICT_MB = 64  # read between calls: more than this host's 32 MB last-level cache
CHUNK = 512  # positions a prefill step adds
PROBE_MB = 256  # the bandwidth probe's least buffer: from memory, not from the caches


class Case:
    """One shape at one depth: its layers' caches, a query, and a call of one build."""

    def __init__(
        self, heads: int, kv: int, hd: int, depth: int, plain: bool = False, paged: int = 0
    ) -> None:
        rng = np.random.default_rng(0)
        self.shape, self.depth = (heads, kv, hd), depth
        self.caches = [prefilled_kv(kv, hd, depth, CHUNK) for _ in range(LAYERS)]
        for c in self.caches:
            c.reserve(1)  # the new position's room
        layers = [c.buffers(0) for c in self.caches]
        if plain:  # the same bits in numpy's own arrays
            layers = [(k.copy(), v.copy()) for k, v in layers]
        self.entries: list[Entry] = [(k, v, depth, 1, 0) for k, v in layers]
        self.pages: list[list[KVPage]] = []
        if paged:  # the same bits, read from pages of a model of ``paged`` such layers
            self.entries = [self._shared(k, v, paged) for k, v in layers]
        self.q = rng.standard_normal((1, heads * hd)).astype(np.float32)
        self.kv_row = rng.standard_normal((1, kv * hd)).astype(np.float32)
        self.evict = np.ones((EVICT_MB << 20) // 8, np.uint64)

    def _shared(self, keys: np.ndarray, values: np.ndarray, paged: int) -> Entry:
        """A native attention entry reading ``keys``, ``values``' whole pages from pages
        (their first paged layer's) and the rest from arrays of its own."""
        _, kv, hd = self.shape
        whole = self.depth // PAGE_TOKENS * PAGE_TOKENS
        pages = []
        for at in range(0, whole, PAGE_TOKENS):
            page = KVPage(paged, kv, hd, np.dtype(np.float32))
            page.array[0, 0] = keys[:, at : at + PAGE_TOKENS]
            page.array[0, 1] = values[:, at : at + PAGE_TOKENS]
            pages.append(page)
        self.pages.append(pages)  # alive as long as the table is used
        own = keys[:, whole:].copy(), values[:, whole:].copy()
        return (*own, self.depth, 1, 0, 0, address_table(pages, 0))

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
        for entry in self.entries * PASSES:
            self.evict.sum()
            start = time.perf_counter()
            build.attend(
                self.q, self.kv_row, self.kv_row, out, [entry], 1, heads, kv, hd, threads,
                hd**-0.5, 0.0, 0,
            )  # fmt: skip
            total += time.perf_counter() - start
        return total / (LAYERS * PASSES), out


def _timed(case: Case, build: ModuleType, threads: int) -> float:
    return case.seconds(build, threads)[0]


def _calls(
    cases: dict[str, Case], builds: dict[str, ModuleType]
) -> list[tuple[str, Case, ModuleType]]:
    """Each build on the node's caches; the new build on the plain and shared ones too."""
    calls = [(b, cases["node"], m) for b, m in builds.items()]
    for other in ("plain", "shared"):
        if other in cases:
            calls.append((other, cases[other], builds["new"]))
    return calls


def bench(builds: dict[str, ModuleType], args: argparse.Namespace, quiet: Quiet) -> None:
    for name, (heads, kv, hd) in SHAPES.items():
        for depth in args.depths:
            cases = {"node": Case(heads, kv, hd, depth)}
            if args.plain:
                cases["plain"] = Case(heads, kv, hd, depth, plain=True)
            if args.shared:
                cases["shared"] = Case(heads, kv, hd, depth, paged=PAGED_LAYERS[name])
            case = cases["node"]
            probe = read_gb_s(max(PROBE_MB, case.read_bytes >> 20), passes=5, threads=args.threads)
            calls = _calls(cases, builds)
            times: dict[str, list[float]] = {b: [] for b, _, _ in calls}
            calm = {b: False for b, _, _ in calls}
            outs: dict[str, np.ndarray] = {}
            for b, c, module in calls:  # warm up: page in, load the code
                outs[b] = c.seconds(module, args.threads)[1].copy()
            for _ in range(args.rounds):
                for b, c, module in calls:
                    tries = quiet.tries(partial(_timed, c, module, args.threads))
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
            if "plain" in times:
                plain = statistics.median(times["plain"])
                line += f"; plain arrays {plain * 1e3:.2f} ms, plain/node {plain / new:.2f}x"
            if "shared" in times:
                shared = statistics.median(times["shared"])
                same = np.array_equal(outs["new"], outs["shared"])
                line += f"; shared pages {shared * 1e3:.2f} ms, shared/node {shared / new:.2f}x"
                line += f", same bits: {'yes' if same else 'NO'}"
            print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", type=Path, help="another build of _native (.so) to compare")
    p.add_argument("--depths", default="4096,16384,32768", help="positions in the cache")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--plain", action="store_true", help="also time numpy's own arrays")
    p.add_argument("--shared", action="store_true", help="also time a prefix's shared pages")
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
