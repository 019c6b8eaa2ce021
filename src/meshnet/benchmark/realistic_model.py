"""The realistic-scale benchmark model on disk: the F16 synthetic file and its K-quant.

``ensure_models`` makes whatever is missing and nothing else, so the benchmark
and the script that prepares it can both call it: the F16 file is written by
``meshnet.benchmark.synthetic_model``, the quantized one by llama.cpp's
``llama-quantize`` (what people run is a file quantized by llama.cpp). Each file
appears under its final name only once complete. ``quantized_once`` is the same
flow for the other benchmark models (Gemma 3, Qwen3-MoE), whose F32 sources are
deleted once quantized.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshnet.benchmark.llama3_vocab import llama3_tokenizer_dir, read_hf_vocabulary
from meshnet.benchmark.seeded_gguf import check_disk
from meshnet.benchmark.synthetic_model import LlamaShape, write_model
from meshnet.errors import ModelError

MODEL_CACHE = Path.home() / ".cache" / "meshnet" / "models"
DEFAULT_QUANT = "Q4_K_M"
_QUANTIZE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class RealisticModel:
    source: Path  # the file our writer made (F16 by default)
    quantized: Path | None  # llama-quantize's output, when asked for


def model_stem(shape: LlamaShape, seed: int) -> str:
    """A name that changes with anything that changes the file's contents."""
    stem = "llama3.2-1b-synthetic" if shape == LlamaShape() else _custom_stem(shape)
    return f"{stem}-s{seed}"


def _custom_stem(shape: LlamaShape) -> str:
    base = LlamaShape()
    parts = [f"llama3-synthetic-L{shape.n_layers}-d{shape.d_model}-ff{shape.d_ff}"]
    if (shape.n_heads, shape.n_kv_heads) != (base.n_heads, base.n_kv_heads):
        parts.append(f"h{shape.n_heads}kv{shape.n_kv_heads}")
    if shape.vocab_size != base.vocab_size:
        parts.append(f"v{shape.vocab_size}")
    if shape.context_length != base.context_length:
        parts.append(f"ctx{shape.context_length}")
    return "-".join(parts)


def ensure_models(
    shape: LlamaShape,
    seed: int = 0,
    weight_type: str = "f16",
    quant: str | None = DEFAULT_QUANT,
    out_dir: Path = MODEL_CACHE,
    quantize_bin: Path | None = None,
    log: Callable[[str], None] = print,
) -> RealisticModel:
    """The source file and (with ``quant``) its quantized copy, made if missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = model_stem(shape, seed)
    source = out_dir / f"{stem}-{weight_type.upper()}.gguf"
    if source.is_file():
        log(f"have {source}")
    else:
        log(f"writing {source} ...")
        vocab = read_hf_vocabulary(llama3_tokenizer_dir())
        write_model(source, shape, vocab, seed, weight_type, name=stem)
        log(f"wrote {source} ({source.stat().st_size / 1e9:.2f} GB)")
    if quant is None:
        return RealisticModel(source, None)
    quantized = out_dir / f"{stem}-{quant}.gguf"
    if quantized.is_file():
        log(f"have {quantized}")
    else:
        _quantize_logged(_need(quantize_bin), source, quantized, quant, log, threads=2)
    return RealisticModel(source, quantized)


def quantize(binary: Path, source: Path, dest: Path, quant: str, threads: int = 2) -> None:
    """Run ``llama-quantize SOURCE DEST QUANT THREADS``, renaming into place on success."""
    tmp = dest.with_name(dest.name + ".part")
    argv = [str(binary), str(source), str(tmp), quant, str(threads)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_QUANTIZE_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise ModelError(f"llama-quantize failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def quantized_once(
    stem: str,
    quant: str,
    out_dir: Path,
    quantize_bin: Path | None,
    source_bytes: int,
    write_source: Callable[[Path], None],
    log: Callable[[str], None] = print,
    threads: int = 2,
) -> Path:
    """``out_dir / STEM-QUANT.gguf``, made if missing: ``write_source`` writes the F32
    source (``source_bytes`` of tensors, the disk checked first), ``quantize_bin``
    (llama.cpp's ``llama-quantize``, on ``threads`` threads) quantizes it, and the
    source is deleted whatever happens: the quantized file is what is kept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quantized = out_dir / f"{stem}-{quant}.gguf"
    if quantized.is_file():
        log(f"have {quantized}")
        return quantized
    binary = _need(quantize_bin)
    source = out_dir / f"{stem}-F32.gguf"
    try:
        if not source.is_file():
            check_disk(out_dir, source_bytes)
            log(f"writing {source} ...")
            write_source(source)
            log(f"wrote {source} ({source.stat().st_size / 1e9:.2f} GB)")
        _quantize_logged(binary, source, quantized, quant, log, threads)
    finally:
        source.unlink(missing_ok=True)
    return quantized


def _need(quantize_bin: Path | None) -> Path:
    """``quantize_bin``, or ``ModelError`` saying how to build it."""
    if quantize_bin is None:
        raise ModelError(
            "llama-quantize not found: run bench/build_llamacpp.sh (or pass its folder)"
        )
    return quantize_bin


def _quantize_logged(
    binary: Path, source: Path, dest: Path, quant: str, log: Callable[[str], None], threads: int
) -> None:
    log(f"quantizing to {dest} ...")
    quantize(binary, source, dest, quant, threads)
    log(f"wrote {dest} ({dest.stat().st_size / 1e9:.2f} GB)")
