"""meshnet on a mixture-of-experts model against llama.cpp on the same file, in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/moe.py [--backend fast] [--tiny]

The model is Qwen3-MoE-shaped (architecture qwen3moe, as llama.cpp's converter
writes Qwen3-30B-A3B): 24 layers, d 1024, 16 query heads of 128 over 4 KV
heads, 64 experts of width 512 of which 8 are used, an untied head, the real
Llama-3 tokenizer; ~2.8B parameters, ~0.56B read per token. Its weights are
seeded random (the router drawn wide enough that its softmax is peaked:
meshnet/benchmark/moe_model.py), written in F32 (11 GB, streaming), quantized
to Q4_K_M (1.7 GB) by llama.cpp's llama-quantize, and the F32 file deleted;
made on first use in ~/.cache/meshnet/models (several minutes) unless --model
names another file. --tiny makes and measures a 3-layer, d 256, 8-expert file
instead: the harness checked in a minute.

Printed, each next to llama.cpp's figure and the ratio (the goals of the MoE
issue in brackets):

- single process, --threads threads each side: prefill of a --prompt-tokens
  prompt [>= 1.5x] and batch-1 decode [>= 1.2x] against llama-bench;
- that decode as a share of its memory bound [>= 60%]: the streaming read
  bandwidth of --threads threads, measured in the run, over the bytes a token
  reads (attention, router, the 8 chosen experts of each layer, the head);
- 2- and 3-node splits over links held --delay-ms (10) each way [>= 1.5x]
  against llama-bench over as many ggml-rpc-server processes behind the same
  delay proxy, and each node's RSS against its tensors' file bytes + its KV
  [<= 1.15x]; the layers split by bytes as `meshnet up --nodes N` plans them
  (--even-layers: as many layers each).

A model meshnet cannot load is measured on llama.cpp's side alone. The two sides
take turns, one round each, and each figure is the best of its --rounds; in one
process each round first waits (--quiet-wait) for idle CPUs and is taken again
(--retries) while other processes used over 10% of them, every try printed with
that share. The machinery is meshnet/benchmark/model_bench.py, shared with
bench/realistic.py.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from meshnet.benchmark.model_bench import Goals, add_arguments, run
from meshnet.benchmark.moe_model import TINY, MoeShape, ensure_moe_model

GOALS = Goals(prefill=1.5, decode=1.2, bound_share=0.6, split=1.5, rss=1.15)
DELAY_MS = 10.0  # the splits' links, each way: hosts on a network, not one machine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p, delay_ms=DELAY_MS)
    p.add_argument("--tiny", action="store_true", help="a 3-layer, 8-expert model: the harness")
    p.add_argument("--seed", type=int, default=0, help="of the model's weights")
    args = p.parse_args()
    run(args, partial(_model, TINY if args.tiny else MoeShape(), args.seed), GOALS)


def _model(shape: MoeShape, seed: int, bin_dir: Path | None) -> Path:
    quantize = bin_dir / "llama-quantize" if bin_dir is not None else None
    return ensure_moe_model(shape, seed, quantize_bin=quantize)


if __name__ == "__main__":
    main()
