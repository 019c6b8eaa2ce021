"""llama.cpp loads and runs the MoE benchmark's file: the tiny shape, written with the
real Llama-3 tokenizer, quantized to Q4_K_M by llama-quantize, decoded by llama-bench.

Skipped where llama.cpp is not built (bench/build_llamacpp.sh) or the Llama-3
tokenizer is not cached (scripts/fetch_vocabularies.sh): a test fetches nothing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from meshnet.benchmark.llama3_vocab import (
    NPM_VERSION,
    VOCAB_CACHE,
    Vocabulary,
    read_hf_vocabulary,
)
from meshnet.benchmark.llamacpp import find_llamacpp
from meshnet.benchmark.model_bench import step_bytes
from meshnet.benchmark.moe_model import TINY, ensure_moe_model
from meshnet.model.gguf_file import open_gguf

BIN = find_llamacpp()
VOCAB = VOCAB_CACHE / f"llama3-{NPM_VERSION}"

pytestmark = [
    pytest.mark.skipif(
        BIN is None or not (BIN / "llama-quantize").is_file(), reason="llama.cpp not built"
    ),
    pytest.mark.skipif(not (VOCAB / "tokenizer.json").is_file(), reason="no Llama-3 tokenizer"),
]


def test_llama_cpp_runs_the_quantized_tiny_moe(tmp_path: Path) -> None:
    assert BIN is not None
    made = ensure_moe_model(
        TINY, 0, "Q4_K_M", tmp_path, BIN / "llama-quantize", lambda _: None, _vocab()
    )
    types = {t.tensor_type.name for t in open_gguf(made).tensors.values()}
    assert "Q4_K" in types  # quantized, not passed through
    assert open_gguf(made).tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    argv = ["-m", str(made), "-t", "1", "-p", "16", "-n", "4", "-r", "1", "-o", "json"]
    out = subprocess.run(
        [str(BIN / "llama-bench"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = json.loads(out)
    assert {r["model_type"].split()[0] for r in rows} == {"qwen3moe"}
    assert all(float(r["avg_ts"]) > 0 for r in rows)
    assert 0 < step_bytes(open_gguf(made)) < made.stat().st_size


def _vocab() -> Vocabulary:
    return read_hf_vocabulary(VOCAB)
