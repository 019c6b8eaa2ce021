"""Record the quantized mixtures' files and llama.cpp's outputs on their weights.

For each case of ``tests/tinyarch.py``'s QUANT_CASES: write its float32 GGUF, quantize it
with llama.cpp's ``llama-quantize`` (Q4_K_M, or MXFP4_MOE for gpt-oss) into
``tests/fixtures/quant/NAME.gguf`` (committed: CI has no llama.cpp), then write the same
weights dequantized to float32 (``gguf.quants.dequantize``) and record llama.cpp's greedy
steps on that file, float32 throughout. That is a quantized file's exact reference:
llama.cpp multiplies K-quants with 8-bit activations, so its run of the quantized file
itself is not; that run is recorded too, as the q8 backend's reference (it multiplies
as llama.cpp does). The fixture (tests/fixtures/quant_oracle.json) keeps each file's
sha256 and its tensors' types.

Remake both (after ``bash bench/build_llamacpp.sh``) whenever QUANT_CASES changes:

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/record_quant_oracles.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from record_arch_oracles import BANNED, PROMPT, greedy, llama_version  # noqa: E402
from tinyarch import QUANT_CASES, write_arch_gguf  # noqa: E402

from meshnet.benchmark.llamacpp import DEFAULT_HOME  # noqa: E402

FILES = ROOT / "tests" / "fixtures" / "quant"
OUT = ROOT / "tests" / "fixtures" / "quant_oracle.json"
# Top log-probs kept per step: enough that two unbanned ids are among them (the tiny
# random models put much of their mass on the banned byte tokens).
TOP = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, default=DEFAULT_HOME / "bin")
    args = parser.parse_args()
    server, quantize = args.bin / "llama-server", args.bin / "llama-quantize"
    for tool in (server, quantize):
        if not tool.is_file():
            sys.exit(f"{tool} is missing: run bash bench/build_llamacpp.sh first")
    FILES.mkdir(parents=True, exist_ok=True)
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (case, kind) in QUANT_CASES.items():
            f32 = write_arch_gguf(Path(tmp) / f"{name}-f32.gguf", case)
            quantized = FILES / f"{name}.gguf"
            cmd = [str(quantize), str(f32), str(quantized), kind]
            subprocess.run(cmd, check=True, capture_output=True)
            dense = dequantized_copy(quantized, case, Path(tmp) / f"{name}-dequantized.gguf")
            cases[name] = {
                "sha256": hashlib.sha256(quantized.read_bytes()).hexdigest(),
                "quantization": kind,
                "types": tensor_types(quantized),
                "prompt_ids": PROMPT,
                "banned_ids": BANNED,
                "steps": greedy(server, dense, top=TOP),
                # llama.cpp on the quantized file itself: 8-bit activations, the q8
                # backend's arithmetic
                "quantized_steps": greedy(server, quantized, top=TOP),
            }
            print(name, [s["id"] for s in cases[name]["steps"]])
    meta = {"llama_server": llama_version(server), "command": "scripts/record_quant_oracles.py"}
    OUT.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}")


def dequantized_copy(quantized: Path, case: object, out: Path) -> Path:
    """The case written again with every tensor's values those of ``quantized``
    dequantized to float32."""
    reader = gguf.GGUFReader(str(quantized))
    tensors = {t.name: t for t in reader.tensors}

    def values(name: str, drawn: np.ndarray) -> np.ndarray:
        t = tensors[name]
        dense = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        return np.asarray(dense, np.float32).reshape(drawn.shape)

    return write_arch_gguf(out, case, values)  # type: ignore[arg-type]


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's GGML type name, as llama-quantize chose it."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}


if __name__ == "__main__":
    main()
