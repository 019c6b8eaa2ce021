"""Loading a GGUF: typed errors for bad files, only the shard's tensors, every quant type."""

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.backends.shard import load_shard
from meshnet.errors import (
    LayerRangeError,
    ModelFileError,
    UnsupportedArchitecture,
    UnsupportedTensorType,
)
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf, sha256_file
from meshnet.model.spec import read_spec
from meshnet.model.weights import load_shard_weights


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such model file"):
        open_gguf(tmp_path / "absent.gguf")


def test_random_bytes_are_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "junk.gguf"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        open_gguf(p)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_file_is_refused_at_open(tiny_path: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_path.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError):
        open_gguf(p)


def test_flipped_header_bytes_are_refused(tiny_path: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_path.read_bytes())
    data[0] ^= 0xFF  # magic
    p = tmp_path / "flipped.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError):
        open_gguf(p)


def test_unknown_architecture_is_named(tiny_factory) -> None:  # type: ignore[no-untyped-def]
    p = tiny_factory("mamba.gguf", architecture="mamba")
    with pytest.raises(UnsupportedArchitecture, match="'mamba'"):
        read_spec(open_gguf(p))


@pytest.mark.parametrize("text", ["0:5", "3:9", "4:5"])
def test_layer_range_out_of_bounds(tiny_path: Path, text: str) -> None:
    f = open_gguf(tiny_path)
    with pytest.raises(LayerRangeError, match="outside"):
        load_shard(f, read_spec(f), LayerRange.parse(text))


def test_shard_loads_only_what_its_range_needs(tiny_path: Path) -> None:
    f = open_gguf(tiny_path)
    spec = read_spec(f)
    first = load_shard_weights(f, spec, LayerRange(0, 1))
    middle = load_shard_weights(f, spec, LayerRange(1, 3))
    last = load_shard_weights(f, spec, LayerRange(3, 4))
    whole = load_shard_weights(f, spec, LayerRange(0, 4))
    assert first.embedding is not None and first.head is None and first.output_norm is None
    assert middle.embedding is None and middle.head is None and len(middle.blocks) == 2
    assert last.embedding is None and last.head is not None and last.output_norm is not None
    assert whole.head is whole.embedding  # a tied head is the embedding, not a copy
    assert np.array_equal(middle.blocks[0].qkv[0], whole.blocks[1].qkv[0])


def test_untied_head_reads_output_weight(tiny_factory) -> None:  # type: ignore[no-untyped-def]
    f = open_gguf(tiny_factory("untied.gguf", tied_head=False))
    spec = read_spec(f)
    assert not spec.tied_head
    w = load_shard_weights(f, spec, LayerRange(0, spec.n_layers))
    assert w.head is not w.embedding and w.head is not None
    assert w.head.shape == (spec.vocab_size, spec.d_model)


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [
        (QT.F16, 1e-3),
        (QT.BF16, 1e-2),
        (QT.Q8_0, 0.01),
        (QT.Q5_0, 0.06),
        (QT.Q5_1, 0.06),
        (QT.Q4_0, 0.12),
        (QT.Q4_1, 0.12),
    ],
)
def test_quantized_matrices_dequantize_to_the_float_weights(tiny_factory, qtype, tolerance) -> None:  # type: ignore[no-untyped-def]
    exact_f = open_gguf(tiny_factory("f32.gguf", matrix_type=QT.F32, embedding_type=QT.F32))
    quant_f = open_gguf(tiny_factory(f"{qtype.name}.gguf", matrix_type=qtype, embedding_type=qtype))
    spec = read_spec(exact_f)
    exact = load_shard_weights(exact_f, spec, LayerRange(0, spec.n_layers))
    quant = load_shard_weights(quant_f, spec, LayerRange(0, spec.n_layers))
    for a, b in [
        (exact.blocks[2].w_down, quant.blocks[2].w_down),
        (exact.blocks[0].qkv[1], quant.blocks[0].qkv[1]),
        (exact.embedding, quant.embedding),
    ]:
        assert a is not None and b is not None and a.shape == b.shape
        scale = np.abs(a).max()
        assert np.abs(a - b).max() <= tolerance * scale
        assert not b.flags.writeable


def test_unsupported_tensor_type_fails_only_the_shard_that_needs_it(tiny_factory) -> None:  # type: ignore[no-untyped-def]
    f = open_gguf(tiny_factory("iq.gguf", layer_types={1: QT.IQ4_NL}))
    spec = read_spec(f)
    with pytest.raises(UnsupportedTensorType, match="IQ4_NL"):
        load_shard(f, spec, LayerRange(0, 2))
    load_shard(f, spec, LayerRange(2, 4))  # never reads layer 1


def test_fingerprint_is_the_file_sha256(tiny_path: Path) -> None:
    import hashlib

    f = open_gguf(tiny_path)
    assert f.fingerprint() == hashlib.sha256(tiny_path.read_bytes()).hexdigest()
    assert sha256_file(tiny_path) == f.fingerprint()


def test_metadata_and_tensors_equal_the_gguf_readers(tiny_path: Path) -> None:
    reader = gguf.GGUFReader(tiny_path)
    f = open_gguf(tiny_path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # the reader's own entries
    assert sorted(f.metadata) == sorted(keys)
    for key in keys:
        assert f.value(key) == reader.fields[key].contents(), key
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for t in reader.tensors:
        mine = f.tensors[t.name]
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes, mine.n_elements) == (
            t.tensor_type,
            t.data_offset,
            t.n_bytes,
            t.n_elements,
        )
        assert list(mine.shape) == list(t.shape)
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data)
        assert not mine.data.flags.writeable


def _header(*kvs: bytes, n_tensors: int = 0) -> bytes:
    """A GGUF v3 header with the given raw key/value entries."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        # a string claiming 2**62 bytes: refused before anything is allocated
        (
            _key("general.name") + (8).to_bytes(4, "little") + (1 << 62).to_bytes(8, "little"),
            "needs",
        ),
        # an array claiming 2**61 uint32 values
        (
            _key("tokenizer.ggml.token_type")
            + (9).to_bytes(4, "little")
            + (4).to_bytes(4, "little")
            + (1 << 61).to_bytes(8, "little"),
            "needs",
        ),
        # an array of 2**40 strings, each needing at least its 8-byte length
        (
            _key("tokenizer.ggml.tokens")
            + (9).to_bytes(4, "little")
            + (8).to_bytes(4, "little")
            + (1 << 40).to_bytes(8, "little"),
            "needs",
        ),
        (_key("x") + (99).to_bytes(4, "little"), "unknown type 99"),
        (_key("x") + (8).to_bytes(4, "little") + (2).to_bytes(8, "little") + b"\xff\xfe", "UTF-8"),
    ],
)
def test_corrupt_metadata_is_a_typed_error(tmp_path: Path, entry: bytes, match: str) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(_header(entry) + bytes(64))
    with pytest.raises(ModelFileError, match=match):
        open_gguf(p)


def test_counts_larger_than_the_file_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "counts.gguf"
    p.write_bytes(_header(n_tensors=1 << 50) + bytes(64))
    with pytest.raises(ModelFileError, match="needs"):
        open_gguf(p)


def test_a_string_array_cut_short_is_refused(tmp_path: Path) -> None:
    strings = b"".join(_key(s) for s in ["a", "bb", "ccc"])  # length-prefixed, as keys are
    entry = _key("tokenizer.ggml.tokens") + (9).to_bytes(4, "little") + (8).to_bytes(4, "little")
    p = tmp_path / "short.gguf"
    p.write_bytes(_header(entry + (4).to_bytes(8, "little") + strings))  # says 4, holds 3
    with pytest.raises(ModelFileError, match=r"past the end|needs"):
        open_gguf(p)


def _resident_kib(path: Path) -> int:
    """KiB of this process's mappings of ``path`` resident now (``/proc/self/smaps``)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
            ours = len(fields) > 5 and fields[5] == str(path)
        elif ours and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's smaps")
def test_a_parsed_header_leaves_none_of_its_pages_resident(tmp_path: Path) -> None:
    """A node holds its layers, not the header it parsed: a 128k-token vocabulary's
    header is ~8 MB of file pages that stayed resident for as long as the map was open."""
    path = (tmp_path / "vocab.gguf").resolve()
    words = [f"token-{i:06d}" for i in range(60_000)]  # a header of ~1 MB
    weights = np.arange(64, dtype=np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", words)
    w.add_tensor("output_norm.weight", weights)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    f = open_gguf(path)

    assert _resident_kib(path) == 0
    assert f.value("tokenizer.ggml.tokens") == words
    assert np.array_equal(np.asarray(f.tensors["output_norm.weight"].data), weights)
