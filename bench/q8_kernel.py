"""The q8 backend's matmul at a few tokens (a decode step's, one row per stream), one thread.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/q8_kernel.py [--against OLD.so \
        [--against-layouts OLD/quant_layouts.py]] [--tokens 1,8]
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/q8_kernel.py --types Q4_1,Q8_0 \
        --shapes smollm2 --tokens 1,2,4,8 --isa avx2 --settings hot

For each shape (by default an expert of bench/moe.py's Qwen3-MoE, 512x1024 gate/up and
1024x512 down; 2048x768; a dense 4096x4096; ``--shapes smollm2``: the bundled model's
fused q/k/v 960x576, 576x576, fused gate/up 3072x576, down 576x1536 and head 49152x576),
each type (Q4_K, Q5_K, Q6_K by default; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 too; a K-quant only where
the columns are whole super-blocks) and each ``--tokens`` count, the native q8 matmul is
timed at both vector widths (AVX-512 VNNI and AVX2) in two settings: ``hot``, one matrix
called again and again (it stays in the caches: what the kernel itself can do), and
``stream``, calls cycling through copies of it that together pass ``--pool-mb``, one
buffer on huge pages (each call reads its weights from memory, as a decode step reads
its experts). Weights are seeded random blocks in the GGUF layout (the speed does not
depend on their values).

Printed per row: GB/s of the weights read per call; that rate against the Q6_K
kernel's on the same shape and setting, and against a read-bandwidth probe of the
same bytes (numpy's sum over uint64 words of a buffer as large as the matrix, or the
pool, as benchmark/bandwidth.py reads); with ``--against``, the rate of another build
of the native extension (the old kernels) in the same run, and new / old. Where the
change was to a layout, ``--against-layouts`` names the old tree's ``quant_layouts.py``
(copied aside with the old ``.so``): the old build then multiplies the same blocks
packed its way. Every build's rate is over this tree's layout's bytes, so new / old is
the ratio of calls per second.

The machine is shared: every figure is CPU time (time.process_time, one thread, so
other processes' load does not count) over calls of about ``--sample-ms`` each, the
median of ``--rounds`` rounds in which the builds and the probe take turns.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant, quant_layouts
from meshnet.benchmark.native_build import load_build, load_layouts
from meshnet.memory import on_huge_pages

SHAPES = ((512, 1024), (1024, 512), (2048, 768), (4096, 4096))
# SmolLM2-135M's matrices as the q8 backend multiplies them (q/k/v and gate/up fused)
SMOLLM2 = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
KQUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# bytes and columns of a block
BLOCK = {
    QT.Q4_0: (18, 32),
    QT.Q4_1: (20, 32),
    QT.Q8_0: (34, 32),
    QT.Q5_0: (22, 32),
    QT.Q5_1: (24, 32),
    QT.Q4_K: (144, 256),
    QT.Q5_K: (176, 256),
    QT.Q6_K: (210, 256),
}
# float16 scale fields' offsets
D_AT = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes of a ``rows`` x ``cols`` matrix: random quants, small float16 scales
    (Q8_0's quants never -128: a matrix holding it keeps the float32 kernels)."""
    size, width = BLOCK[qtype]
    raw = rng.integers(0, 256, (rows * cols // width, size), dtype=np.uint8)
    if qtype == QT.Q8_0:
        raw[raw == 0x80] = 0x81
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


@dataclass(frozen=True)
class Build:
    """A build of the native extension and the ``quant_layouts`` that packs its matrices."""

    native: ModuleType
    layouts: ModuleType


def packed_for(build: Build, raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> np.ndarray:
    """The blocks ``raw`` in ``build``'s q8 layout of ``qtype``, as ``quant.from_blocks``
    holds a matrix (random_blocks never writes the -128 that keeps Q8_0 from it)."""
    packed = build.layouts.pack(raw, qtype, *shape)
    q8 = build.layouts.q8_layout(packed, qtype)
    if q8 is None:
        raise SystemExit(f"{qtype.name}: no q8 layout")
    return page_aligned(q8)


def page_aligned(a: np.ndarray, page: int = 4096) -> np.ndarray:
    """A copy of the bytes ``a`` starting on a page: numpy places a buffer at 16 bytes
    past one, and two builds' matrices at different offsets within their cache lines
    timed the same Q6_K kernel, hot, 0.8-1.2x apart."""
    buf = np.empty(a.nbytes + page, np.uint8)
    start = -buf.ctypes.data % page
    out = buf[start : start + a.nbytes]
    out[:] = a.reshape(-1).view(np.uint8)
    return out


@dataclass(frozen=True)
class Plan:
    """What each (type, shape, tokens) runs: the vector widths, settings and sampling."""

    widths: tuple[bool, ...]  # True: AVX-512 VNNI, False: AVX2
    settings: tuple[str, ...]  # "hot", "stream"
    pool_mb: int
    rounds: int
    sample_ms: float


def pools_of(packed: np.ndarray, plan: Plan) -> dict[str, list[np.ndarray]]:
    """Per setting, the copies of a matrix its calls cycle through."""
    pools = {"hot": [packed]}
    if "stream" in plan.settings:
        copies = max(1, (plan.pool_mb << 20) // packed.nbytes)
        # one buffer on huge pages, as a model's expert tensors are (a copy each would be
        # on 4 KB pages: under 2 MB, on_huge_pages leaves it)
        pool = on_huge_pages(np.concatenate([packed.reshape(-1)] * copies))
        size = packed.size
        pools["stream"] = [
            pool[i * size : (i + 1) * size].reshape(packed.shape) for i in range(copies)
        ]
    return pools


def measure(
    builds: dict[str, Build], qtype: QT, shape: tuple[int, int], tokens: int, plan: Plan
) -> dict[tuple[str, bool, str], float]:
    """GB/s per (build, wide, setting), and the probe's per setting ("probe", False, s)."""
    raw = random_blocks(qtype, *shape, np.random.default_rng(0))
    w = quant.from_blocks(raw, qtype, shape, q8=True)
    packed = quant.native_args(w)[0]
    pools = {name: pools_of(packed_for(b, raw, qtype, shape), plan) for name, b in builds.items()}
    fns: dict[tuple[str, bool, str], Callable[[int], object]] = {}
    for setting in plan.settings:
        for name, build in builds.items():
            for wide in plan.widths:
                mats = pools[name][setting]
                fns[(name, wide, setting)] = matmul_fn(build.native, mats, w, wide, tokens)
        mats = pools["new"][setting]
        words = np.ones(packed.nbytes * len(mats) // 8, np.uint64)
        parts = np.array_split(words, len(mats))
        fns[("probe", False, setting)] = lambda i, parts=parts: parts[i % len(parts)].sum()
    calls = {}
    for key, fn in fns.items():  # warm up, and size each sample to about sample_ms
        per = cpu_per_call(fn, 3)
        calls[key] = max(3, int(plan.sample_ms / 1e3 / max(per, 1e-7)))
    samples: dict[tuple[str, bool, str], list[float]] = {key: [] for key in fns}
    for _ in range(plan.rounds):
        for key, fn in fns.items():
            samples[key].append(packed.nbytes / cpu_per_call(fn, calls[key]) / 1e9)
    return {key: statistics.median(v) for key, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", type=Path, help="another build of _native (.so) to compare")
    p.add_argument(
        "--against-layouts", type=Path, help="the quant_layouts.py that packs --against's matrices"
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sample-ms", type=float, default=60.0, help="CPU time per sample")
    p.add_argument("--pool-mb", type=int, default=256, help="stream setting's bytes (past L3)")
    p.add_argument("--tokens", default="1", help="rows of x a call, comma-separated (e.g. 1,2,4,8)")
    p.add_argument(
        "--types", default="Q4_K,Q5_K,Q6_K", help=f"of {', '.join(q.name for q in BLOCK)}"
    )
    p.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES), help="or smollm2")
    p.add_argument("--isa", default="avx512,avx2", help="vector widths to time")
    p.add_argument("--settings", default="hot,stream")
    args = p.parse_args()
    if quant.NATIVE is None:
        raise SystemExit("the native extension is not built")
    builds = {"new": Build(quant.NATIVE, quant_layouts)}
    if args.against is not None:
        old_layouts = quant_layouts
        if args.against_layouts is not None:
            old_layouts = load_layouts(args.against_layouts)
        builds["old"] = Build(load_build(args.against), old_layouts)
    types = [QT[name] for name in args.types.split(",")]
    pairs = SMOLLM2 if args.shapes == "smollm2" else [s.split("x") for s in args.shapes.split(",")]
    shapes = [(int(r), int(c)) for r, c in pairs]
    plan = Plan(
        widths=tuple(isa == "avx512" for isa in args.isa.split(",")),
        settings=tuple(args.settings.split(",")),
        pool_mb=args.pool_mb,
        rounds=args.rounds,
        sample_ms=args.sample_ms,
    )
    print(f"one thread, CPU time, median of {args.rounds}; GB/s of weights read per call")
    head = f"{'shape':>10} {'type':>5} {'T':>2} {'isa':>6} {'setting':>7} {'GB/s':>6} {'/Q6_K':>6}"
    print(head + f" {'/probe':>6}" + (f" {'old':>6} {'new/old':>7}" if "old" in builds else ""))
    for shape in shapes:
        for tokens in (int(t) for t in args.tokens.split(",")):
            fit = [q for q in types if shape[1] % BLOCK[q][1] == 0]  # whole blocks a row
            results = {q: measure(builds, q, shape, tokens, plan) for q in fit}
            for qtype in fit:
                for wide in plan.widths:
                    for setting in plan.settings:
                        line = report_line(results, qtype, shape, tokens, wide, setting)
                        print(line, flush=True)


def report_line(
    results: dict[QT, dict[tuple[str, bool, str], float]],
    qtype: QT,
    shape: tuple[int, int],
    tokens: int,
    wide: bool,
    setting: str,
) -> str:
    """One row of the table: the new build's GB/s and its ratios."""
    r = results[qtype]
    gb = r[("new", wide, setting)]
    q6 = results[QT.Q6_K][("new", wide, setting)] if QT.Q6_K in results else float("nan")
    probe = r[("probe", False, setting)]
    name = f"{shape[0]}x{shape[1]}"
    line = f"{name:>10} {qtype.name:>5} {tokens:>2} {'avx512' if wide else 'avx2':>6} {setting:>7}"
    line += f" {gb:6.1f} {gb / q6:6.2f} {gb / probe:6.2f}"
    if ("old", wide, setting) in r:
        old = r[("old", wide, setting)]
        line += f" {old:6.1f} {gb / old:7.2f}"
    return line


if __name__ == "__main__":
    main()
