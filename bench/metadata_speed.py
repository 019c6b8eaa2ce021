"""Time to read a GGUF's metadata and build its tokenizer, on real large vocabularies.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/metadata_speed.py [--rounds 3] [--reader]

Writes tiny GGUFs carrying the Llama-3 (128k tokens, 280k merges) and Qwen3
(151k tokens, 151k merges) vocabularies (fetched by scripts/fetch_vocabularies.sh),
then prints, best of --rounds: ``open_gguf`` (header, every metadata value and
tensor descriptor; goal: well under a second) and ``load_tokenizer``. With
--reader, also ``gguf.GGUFReader`` reading every field, the way meshnet read
them before (about 30 s for Llama-3's vocabulary).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import gguf  # noqa: E402
from vocab_gguf import FAMILIES, family_dir, fetch_vocabularies, write_vocab_gguf  # noqa: E402

from meshnet.model.gguf_file import open_gguf  # noqa: E402
from meshnet.model.tokenizer import load_tokenizer  # noqa: E402


def best_of(rounds: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_with_gguf_reader(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    for field in reader.fields.values():
        field.contents()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reader", action="store_true", help="also time gguf.GGUFReader (slow)")
    args = p.parse_args()
    cache = fetch_vocabularies()
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("llama3", "qwen3"):
            path = write_vocab_gguf(
                family_dir(cache, name), FAMILIES[name], Path(tmp) / f"{name}.gguf"
            )
            f = open_gguf(path)
            n_tokens = len(f.value("tokenizer.ggml.tokens"))
            n_merges = len(f.value("tokenizer.ggml.merges"))
            opened = best_of(args.rounds, lambda path=path: open_gguf(path))
            built = best_of(args.rounds, lambda f=f: load_tokenizer(f))
            print(
                f"{name}: {n_tokens} tokens, {n_merges} merges, {path.stat().st_size / 1e6:.1f} MB"
            )
            print(f"  open_gguf (all metadata)   : {opened * 1000:8.1f} ms")
            print(f"  load_tokenizer             : {built * 1000:8.1f} ms")
            if args.reader:
                slow = best_of(1, lambda path=path: read_with_gguf_reader(path))
                print(f"  gguf.GGUFReader + contents : {slow * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
