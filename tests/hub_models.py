"""A hub folder of tiny GGUFs for the model-reference tests (``hub_server.HubServer``).

``test/tiny`` holds ``tiny-Q4_K_M.gguf`` (8 layers of Q4_K matrices, so a half of its
layers is about half of its bytes) and ``tiny-Q8_0.gguf``; ``test/empty`` holds no
model file.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as QT
from tinymodel import TinyConfig, write_tiny_gguf

REPO = "test/tiny"
Q4 = "tiny-Q4_K_M.gguf"
Q8 = "tiny-Q8_0.gguf"
N_LAYERS = 8


def write_hub(root: Path) -> Path:
    """Write the repositories under ``root``; returns ``root``."""
    repo = root / REPO
    repo.mkdir(parents=True)
    shape = {"n_layers": N_LAYERS, "d_model": 256, "d_ff": 512, "n_heads": 4, "n_kv_heads": 2}
    write_tiny_gguf(repo / Q4, TinyConfig(**shape, matrix_type=QT.Q4_K))
    write_tiny_gguf(repo / Q8, TinyConfig(**shape, matrix_type=QT.Q8_0, seed=1))
    (repo / "README.md").write_text("tiny test models\n")
    (root / "test" / "empty").mkdir()
    (root / "test" / "empty" / "README.md").write_text("nothing\n")
    return root
