"""A hub folder of tiny GGUFs for the model-reference tests (``hub_server.HubServer``).

``test/tiny`` publishes its Q4_K_M split, as large models are published: three parts
``tiny-Q4_K_M-0000K-of-00003.gguf`` (written with ``gguf_splitter``, llama.cpp's split
keys; the first part's tensors end midway through a layer), 8 layers of Q4_K matrices,
so a half of its layers is about half of its bytes; and ``tiny-Q8_0.gguf`` whole.
The Q4_K_M as one file lies beside the hub (``unsplit_q4``): what answers are compared
with. ``test/empty`` holds no model file.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as QT
from gguf_splitter import split_gguf
from tinymodel import TinyConfig, write_tiny_gguf

REPO = "test/tiny"
Q4 = "tiny-Q4_K_M.gguf"  # the unsplit file's name (not on the hub)
Q4_PARTS = tuple(f"tiny-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3))
Q8 = "tiny-Q8_0.gguf"
N_LAYERS = 8
_PART_TENSORS = 30  # 75 tensors: parts of 30, 30 and 15


def write_hub(root: Path) -> Path:
    """Write the repositories under ``root``; returns ``root``."""
    repo = root / REPO
    repo.mkdir(parents=True)
    shape = {"n_layers": N_LAYERS, "d_model": 256, "d_ff": 512, "n_heads": 4, "n_kv_heads": 2}
    whole = unsplit_q4(root)
    whole.parent.mkdir(parents=True)
    write_tiny_gguf(whole, TinyConfig(**shape, matrix_type=QT.Q4_K, tied_head=False))
    parts = split_gguf(whole, repo / Q4, _PART_TENSORS)
    assert tuple(p.name for p in parts) == Q4_PARTS, parts
    write_tiny_gguf(repo / Q8, TinyConfig(**shape, matrix_type=QT.Q8_0, seed=1))
    (repo / "README.md").write_text("tiny test models\n")
    (root / "test" / "empty").mkdir()
    (root / "test" / "empty" / "README.md").write_text("nothing\n")
    return root


def unsplit_q4(root: Path) -> Path:
    """The Q4_K_M the hub publishes split, as one file (outside the hub's repositories)."""
    return root / "unsplit" / Q4


def q4_size(root: Path) -> int:
    """The published Q4_K_M's bytes, its parts together."""
    return sum((root / REPO / p).stat().st_size for p in Q4_PARTS)
