"""llama.cpp as the speed peer, measured in the same run as the engine.

The binaries come from ``bench/build_llamacpp.sh`` (built outside the repo).
``llama-bench`` gives prefill and batch-1 decode (with ``-d``, decode deep in a
context); ``llama-batched-bench``
gives aggregate decode of B parallel sequences, as ``llama-server -np B`` runs
them. One call is one round; ``meshnet bench`` alternates rounds with ours.
The build script records the ``GGML_*`` options it built with beside ``bin/``;
``peer_isa`` reads them back so a figure says which vector extensions the peer
had.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from meshnet.benchmark.figures import Throughput

DEFAULT_HOME = Path.home() / ".cache" / "meshnet" / "llama.cpp"
# The peer an AVX2-only CPU gets (``LLAMACPP_ISA=avx2 bench/build_llamacpp.sh``).
AVX2_HOME = Path.home() / ".cache" / "meshnet" / "llama.cpp-avx2"
# The most a run of llama.cpp's may take, and 0.1 s more for every token it prefills: a
# 1B model's 32k prompt takes ~25 minutes on 2 threads.
_TIMEOUT_S = 900
_TIMEOUT_PER_TOKEN_S = 0.1
# llama-bench warms up with a whole prompt's run first; from this many tokens a prompt's
# own run takes seconds to minutes, so what a warm-up settles (threads, buffers) is noise
# in it, and the warm-up would double the wait (a 1B model's 16k prefill: ~5 minutes).
WARM_UP_UNDER = 2048


def find_llamacpp(bin_dir: str | None = None) -> Path | None:
    """The directory holding llama-bench and llama-batched-bench, if built.

    With ``MESHNET_ISA=avx2`` (our kernels kept to AVX2 on an AVX-512 host) the
    AVX2-only build comes first, so both sides run what an AVX2-only CPU has.
    """
    candidates = [Path(bin_dir)] if bin_dir else []
    if env := os.environ.get("LLAMACPP_HOME"):
        candidates.append(Path(env) / "bin")
    if os.environ.get("MESHNET_ISA") == "avx2":
        candidates.append(AVX2_HOME / "bin")
    candidates.append(DEFAULT_HOME / "bin")
    for d in candidates:
        if (d / "llama-bench").is_file() and (d / "llama-batched-bench").is_file():
            return d
    return None


def peer_isa(bin_dir: Path) -> list[str] | None:
    """The instruction-set options llama.cpp in ``bin_dir`` was built with (``AVX2``,
    ``AVX512``, ``AVX512_VNNI``, ...), from the ``build-flags`` record that
    ``bench/build_llamacpp.sh`` writes; None when there is no record (a build made
    before the record existed, or by hand)."""
    try:
        record = (bin_dir.parent / "build-flags").read_text()
    except OSError:
        return None
    isa = []
    for word in record.split():
        name, _, value = word.removeprefix("-D").partition("=")
        if name.startswith("GGML_") and name != "GGML_NATIVE" and value == "ON":
            isa.append(name.removeprefix("GGML_"))
    return isa


def peer_text(bin_dir: Path) -> str:
    """Which llama.cpp a benchmark ran against, for its report."""
    isa = peer_isa(bin_dir)
    if isa is None:
        built = "unrecorded extensions (rerun bench/build_llamacpp.sh to record them)"
    else:
        built = " ".join(isa) if isa else "no vector extensions"
    return f"llama.cpp in {bin_dir}, built with {built}"


def bench_llamacpp(
    bin_dir: Path,
    model: Path,
    prompt_tokens: int,
    decode_tokens: int,
    batches: Sequence[int],
    threads: int,
    at_depth: bool = False,
    kv_cache: str = "f16",
) -> Throughput:
    """One round of llama.cpp's own benchmarks on ``model`` with ``threads`` threads and
    a KV cache of ``kv_cache`` ("f16", its default, or "f32"); with ``at_depth`` also its
    decode after ``prompt_tokens`` (``llama-bench -d``)."""
    cache = ["-ctk", kv_cache, "-ctv", kv_cache]
    bench = partial(_llama_bench, bin_dir, model, threads, cache)
    rows = bench(prompt_tokens, decode_tokens, 0)
    prefill = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] and not r["n_gen"])
    decode = {1: next(float(r["avg_ts"]) for r in rows if r["n_gen"] and not r["n_prompt"])}
    deep = None
    if at_depth:  # its own run: a depth applies to every test of a run, prefill too
        deep_rows = bench(0, decode_tokens, prompt_tokens)
        deep = next(float(r["avg_ts"]) for r in deep_rows if r["n_gen"] and not r["n_prompt"])
    parallel = [b for b in batches if b > 1]
    if parallel:
        out = _run(
            [
                str(bin_dir / "llama-batched-bench"),
                "-m",
                str(model),
                "-t",
                str(threads),
                "-c",
                str(max(parallel) * (16 + decode_tokens) + 64),
                "-npp",
                "16",
                "-ntg",
                str(decode_tokens),
                "-npl",
                ",".join(map(str, parallel)),
                "--output-format",
                "jsonl",
                *cache,
            ]
        )
        for line in out.splitlines():
            if line.startswith("{") and '"speed_tg"' in line:
                row = json.loads(line)
                decode[int(row["pl"])] = float(row["speed_tg"])
    return Throughput(prefill, decode, deep)


def _llama_bench(
    bin_dir: Path, model: Path, threads: int, cache: list[str], prompt: int, gen: int, depth: int
) -> list[dict[str, Any]]:
    """llama-bench's rows (one round each) for a prompt of ``prompt`` and a decode of
    ``gen`` tokens, both after ``depth`` tokens already in the cache (``cache``: its
    type's flags)."""
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), *cache]
    argv += ["-p", str(prompt), "-n", str(gen), "-d", str(depth), "-r", "1", "-o", "json"]
    if prompt >= WARM_UP_UNDER:  # its warm-up is the whole prompt again: minutes at 16k
        argv.append("--no-warmup")
    timeout_s = _TIMEOUT_S + _TIMEOUT_PER_TOKEN_S * (prompt + depth)
    rows: list[dict[str, Any]] = json.loads(_run(argv, timeout_s))
    return rows


def _run(argv: list[str], timeout_s: float = _TIMEOUT_S) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    return done.stdout
