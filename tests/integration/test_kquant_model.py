"""A model of K-quant blocks (a Q4_K_M / Q5_K_M file's mix) runs from its blocks with the
float32 reference's results: the reference dequantizes the same weights whole, which is
the exact reference for a quantized file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from invariants import step_logits
from tinymodel import TinyConfig, write_tiny_gguf

from meshnet.engine.local import load_local_model

MIXES = {
    "Q4_K_M": (QT.Q4_K, {"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K}),
    "Q5_K_M": (QT.Q5_K, {"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K}),
    "Q2_K+Q3_K": (QT.Q2_K, {"attn_v": QT.Q3_K, "ffn_down": QT.Q3_K, "output": QT.Q8_0}),
}


@pytest.fixture(scope="module", params=sorted(MIXES))
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    matrix, roles = MIXES[request.param]
    cfg = TinyConfig(
        d_model=256,
        d_ff=512,
        n_heads=4,
        n_kv_heads=2,
        matrix_type=matrix,
        embedding_type=QT.Q4_K,
        tied_head=False,
        role_types=roles,
    )
    return write_tiny_gguf(tmp_path_factory.mktemp("kq") / f"{request.param}.gguf", cfg)


def test_a_kquant_model_gives_the_reference_logits_and_ids(path: Path) -> None:
    prompt, follow = [5, 17, 40, 99, 123, 7, 64, 200], [31, 90, 12, 150]
    fast = step_logits(load_local_model(path, backend="fast").chain, prompt, follow)
    ref = step_logits(load_local_model(path, backend="numpy").chain, prompt, follow)
    assert np.max(np.abs(fast - ref)) < 1e-4 * np.max(np.abs(ref))
    assert np.array_equal(fast.argmax(axis=1), ref.argmax(axis=1))


@pytest.mark.parametrize("backend", ["fast", "q8"])
def test_a_kquant_model_split_and_alone_are_bit_identical(path: Path, backend: str) -> None:
    prompt, follow = [5, 17, 40, 99, 123, 7, 64, 200], [31, 90, 12, 150]
    whole = step_logits(load_local_model(path, backend=backend).chain, prompt, follow)
    split = step_logits(load_local_model(path, backend=backend, split=2).chain, prompt, follow)
    assert np.array_equal(whole, split)
