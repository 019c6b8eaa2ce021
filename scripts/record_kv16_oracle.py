"""Record llama.cpp's greedy steps on the bundled model with a float16 KV cache.

The q8-kv16 backend stores keys and values as llama.cpp's default cache does (float16,
rounded to nearest); its reference is llama-server on the same file with ``-ctk f16 -ctv
f16`` and flash attention off, which multiplies the weights with 8-bit activations as
q8 does. The same run with a float32 cache is kept beside it, so a test can tell where the
cache's rounding moves an id. Writes tests/fixtures/kv16_oracle.json.

Remake (after ``bash bench/build_llamacpp.sh``) when the bundled model or PROMPT changes:

    .venv/bin/python scripts/record_kv16_oracle.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from record_arch_oracles import greedy, llama_version  # noqa: E402

from meshnet.benchmark.llamacpp import DEFAULT_HOME  # noqa: E402
from meshnet.model.info import load_model_info  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "kv16_oracle.json"
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant who answers at length.<|im_end|>\n"
    "<|im_start|>user\nTell me about the history of Paris, from the Romans to today."
    "<|im_end|>\n<|im_start|>assistant\n"
)
STEPS = 64
TOP = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, default=DEFAULT_HOME / "bin")
    args = parser.parse_args()
    server = args.bin / "llama-server"
    if not server.is_file():
        sys.exit(f"{server} is missing: run bash bench/build_llamacpp.sh first")
    info = load_model_info(None)
    ids = info.tokenizer.encode(PROMPT)
    model = Path(info.file.path)
    runs = {
        cache: greedy(server, model, TOP, cache, ids, STEPS, banned=[], context=512)
        for cache in ("f16", "f32")
    }
    record = {
        "meta": {
            "llama_server": llama_version(server),
            "command": "scripts/record_kv16_oracle.py",
            "model": model.name,
            "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        },
        "prompt_ids": ids,
        "steps": runs,
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}: {STEPS} steps with each cache")


if __name__ == "__main__":
    main()
