"""llama.cpp as the speed peer, measured in the same run as the engine.

The binaries come from ``bench/build_llamacpp.sh`` (built outside the repo).
``llama-bench`` gives prefill and batch-1 decode; ``llama-batched-bench``
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
from pathlib import Path

from meshnet.benchmark.figures import Throughput

DEFAULT_HOME = Path.home() / ".cache" / "meshnet" / "llama.cpp"
# The peer an AVX2-only CPU gets (``LLAMACPP_ISA=avx2 bench/build_llamacpp.sh``).
AVX2_HOME = Path.home() / ".cache" / "meshnet" / "llama.cpp-avx2"
_TIMEOUT_S = 900


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


def bench_llamacpp(
    bin_dir: Path,
    model: Path,
    prompt_tokens: int,
    decode_tokens: int,
    batches: Sequence[int],
    threads: int,
) -> Throughput:
    """One round of llama.cpp's own benchmarks on ``model`` with ``threads`` threads."""
    rows = json.loads(
        _run(
            [
                str(bin_dir / "llama-bench"),
                "-m",
                str(model),
                "-t",
                str(threads),
                "-p",
                str(prompt_tokens),
                "-n",
                str(decode_tokens),
                "-r",
                "1",
                "-o",
                "json",
            ]
        )
    )
    prefill = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] and not r["n_gen"])
    decode = {1: next(float(r["avg_ts"]) for r in rows if r["n_gen"] and not r["n_prompt"])}
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
            ]
        )
        for line in out.splitlines():
            if line.startswith("{") and '"speed_tg"' in line:
                row = json.loads(line)
                decode[int(row["pl"])] = float(row["speed_tg"])
    return Throughput(prefill, decode)


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    return done.stdout
