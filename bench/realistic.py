"""meshnet on a model of the size people run, against llama.cpp on the same file, in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/realistic.py [--backend fast]

The model is a Llama-3.2-1B-shaped GGUF with seeded random weights and the real
Llama-3 tokenizer, quantized to Q4_K_M by llama.cpp's llama-quantize; it is made
on first use in ~/.cache/meshnet/models (scripts/make_synthetic_model.py, a few
minutes) unless --model names another file. Printed, each next to its peer and
the ratio:

- single process: prefill of a --prompt-tokens prompt and batch-1 decode, the
  engine with --threads kernel threads against llama-bench -t THREADS;
- a 2- and 3-node split (--nodes): meshnet's loopback mesh (tracker + node
  processes, --split-threads kernel threads each), decode as the client sees
  streamed tokens, against llama-bench over as many local ggml-rpc-server
  processes of as many threads (with more than one, llama.cpp's figure is the
  better of libgomp's default spin and a short one: benchmark/split.py);
- each node's RSS against the file bytes of the tensors it serves plus the KV
  of one benchmark sequence;
- with --delay-ms, the splits' links held that long each way by a user-space
  proxy (meshnet/benchmark/delay_proxy.py), as over a network: llama-bench's link
  to each RPC server, and every connection to a node (the tracker's, the
  previous hop's, its relay port's). Per token llama.cpp's RPC client makes
  round trips to every server; meshnet's ring crosses one link a hop;
- the memory ceiling of batch-1 decode, measured in the run: the streaming
  read bandwidth of --threads threads (and of one) over the weight bytes a
  decode step reads (meshnet/benchmark/bandwidth.py); the single-process
  decode is set against the first, and a split's nodes, which take turns on
  one stream, against the second.

The machinery is meshnet/benchmark/model_bench.py, shared with bench/moe.py.

Goals (issue 13): decode >= llama.cpp single-process, split >= 1.5x llama.cpp's
RPC split, RSS within ~15% of layer bytes + KV. The two sides take turns, one
round each, and each figure is the best of its --rounds (neighbours on a shared
VM move single runs by 20-40%); in one process each round first waits
(--quiet-wait) for idle CPUs and is taken again (--retries) while other
processes used over 10% of them, every try printed with that share.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnet.benchmark.model_bench import Goals, add_arguments, run
from meshnet.benchmark.realistic_model import ensure_models
from meshnet.benchmark.synthetic_model import LlamaShape

GOALS = Goals(
    decode=1.0,  # meshnet / llama.cpp, single process
    split=1.5,  # meshnet mesh / llama.cpp RPC split
    rss=1.15,  # node RSS / (its tensors' file bytes + KV)
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    run(p.parse_args(), _default_model, GOALS)


def _default_model(bin_dir: Path | None) -> Path:
    quantize = bin_dir / "llama-quantize" if bin_dir is not None else None
    made = ensure_models(LlamaShape(), quantize_bin=quantize)
    if made.quantized is None:
        raise SystemExit("no quantized model was made")
    return made.quantized


if __name__ == "__main__":
    main()
