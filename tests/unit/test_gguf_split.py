"""Split GGUFs (``model.gguf_split``): a model opened by its first part reads every
part's tensors, computes as the unsplit file, and a broken split is a typed error."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf_splitter import split_gguf

from meshnet.backends.base import BatchEntry
from meshnet.backends.shard import load_shard_file
from meshnet.errors import ModelFileError
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf, sha256_file
from meshnet.model.gguf_split import model_stem, parse_split_name, split_fingerprint
from meshnet.model.info import load_model_info

_LLAMA_SPLIT = Path.home() / ".cache/meshnet/llama.cpp/build/bin/llama-gguf-split"


@pytest.fixture(scope="module")
def parts(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return split_gguf(tiny_path, tmp_path_factory.mktemp("split") / "tiny.gguf", 10)


def test_split_names_are_llama_cpps() -> None:
    name = parse_split_name("dir/m-Q4_K_M-00002-of-00003.gguf")
    assert name is not None and (name.no, name.count) == (1, 3)
    assert name.part(0) == "dir/m-Q4_K_M-00001-of-00003.gguf"
    assert model_stem("dir/m-Q4_K_M-00002-of-00003.gguf") == "m-Q4_K_M"
    assert parse_split_name("m-00004-of-00003.gguf") is None
    assert parse_split_name("m.gguf") is None


def test_the_first_part_opens_every_tensor_with_the_files_bytes(
    tiny_path: Path, parts: list[Path]
) -> None:
    whole, split = open_gguf(tiny_path), open_gguf(parts[0])
    assert len(parts) > 2 and split.parts == tuple(parts)
    assert split.tensors.keys() == whole.tensors.keys()
    for name, t in whole.tensors.items():
        assert np.array_equal(split.read_tensor(split.tensors[name]), whole.read_tensor(t))
    assert split.fingerprint() == split_fingerprint([sha256_file(p) for p in parts])
    assert load_model_info(parts[0]).name == "tiny"


def test_a_split_shard_computes_as_the_unsplit_file(tiny_path: Path, parts: list[Path]) -> None:
    def forward(path: Path, layers: LayerRange, x: np.ndarray) -> np.ndarray:
        shard = load_shard_file(str(path), layers, "fast")
        return shard.forward(x, [BatchEntry(shard.backend.new_kv(), len(x))])

    n = open_gguf(tiny_path).value("llama.block_count")
    ids = np.array([5, 1, 9, 2])
    for layers in (LayerRange(0, n), LayerRange(0, 1)):
        assert np.array_equal(forward(parts[0], layers, ids), forward(tiny_path, layers, ids))


def test_a_broken_split_is_a_typed_error(parts: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="open its first part"):
        open_gguf(parts[1])
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / parts[-1].name).unlink()
    with pytest.raises(ModelFileError, match="parts missing"):
        open_gguf(tmp_path / parts[0].name)
    shutil.copy(parts[2], tmp_path / parts[-1].name)  # part 3 under the last part's name
    with pytest.raises(ModelFileError, match="split keys say part 2"):
        open_gguf(tmp_path / parts[0].name)


@pytest.mark.skipif(not _LLAMA_SPLIT.is_file(), reason="llama-gguf-split is not built")
def test_llama_cpps_split_and_merge_agree_with_ours(
    tiny_path: Path, parts: list[Path], tmp_path: Path
) -> None:
    run = [str(_LLAMA_SPLIT)]
    subprocess.run([*run, "--split-max-tensors", "10", str(tiny_path), str(tmp_path / "c")],
                   check=True, capture_output=True)  # fmt: skip
    theirs = open_gguf(tmp_path / parts[0].name.replace("tiny", "c"))
    assert theirs.part_of == open_gguf(parts[0]).part_of
    merged = tmp_path / "merged.gguf"
    subprocess.run([*run, "--merge", str(parts[0]), str(merged)], check=True, capture_output=True)
    whole, back = open_gguf(tiny_path), open_gguf(merged)
    for name, t in whole.tensors.items():
        assert np.array_equal(back.read_tensor(back.tensors[name]), whole.read_tensor(t))
