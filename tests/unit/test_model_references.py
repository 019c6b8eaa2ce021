"""Model references, quantization picking, manifests and their signatures: the pure parts
of ``meshnet.model_source`` (the hub itself is in tests/integration/test_model_source.py)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest

from meshnet.auth.signing import manifest_mac, verify_manifest
from meshnet.errors import (
    DiskFull,
    ModelRefNotFound,
    ModelSourceError,
    RequestError,
    Unauthenticated,
)
from meshnet.model_source.files import check_room
from meshnet.model_source.manifest import FileHash, Manifest, TensorHash, parse_manifest
from meshnet.model_source.quant import pick_files
from meshnet.model_source.reference import HubRef, UrlRef, is_reference, parse_ref
from meshnet.tracker.serving.manifests import ManifestBook

FILES = [
    "README.md",
    "model-Q4_K_M.gguf",
    "model-Q4_K_S.gguf",
    "model.q8_0.gguf",
    "model-IQ4_XS.gguf",
    "mmproj-model-f16.gguf",
    "big/model-Q6_K-00002-of-00002.gguf",
    "big/model-Q6_K-00001-of-00002.gguf",
]


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("hf:org/repo", HubRef("org/repo")),
        ("hf:org/repo:Q4_K_M", HubRef("org/repo", quant="Q4_K_M")),
        ("hf:org/repo/sub/x.gguf", HubRef("org/repo", filename="sub/x.gguf")),
        ("https://example.org/m/x.gguf", UrlRef("https://example.org/m/x.gguf")),
    ],
)
def test_references_parse(text: str, ref: object) -> None:
    assert is_reference(text)
    assert parse_ref(text) == ref
    assert str(parse_ref(text)) == text


@pytest.mark.parametrize(
    "text",
    ["hf:org", "hf:/repo", "hf:org/repo:Q4 K", "hf:org/repo/../x.gguf", "hf:org/repo/x.bin",
     "hf:org/repo/x.gguf:Q4_K_M", "https://host", "hf:" + "a" * 3000],
)  # fmt: skip
def test_malformed_references_are_typed_errors(text: str) -> None:
    with pytest.raises(ModelSourceError):
        parse_ref(text)


def test_a_path_is_not_a_reference() -> None:
    assert not is_reference("/models/x.gguf") and not is_reference(None)


def test_a_quantization_picks_its_file_as_a_whole_word_ignoring_case() -> None:
    assert pick_files(FILES, "q4_k_m", "o/r") == ("model-Q4_K_M.gguf",)
    assert pick_files(FILES, "Q8_0", "o/r") == ("model.q8_0.gguf",)
    assert pick_files(FILES, "IQ4_XS", "o/r") == ("model-IQ4_XS.gguf",)
    assert pick_files(FILES, None, "o/r") == ("model-Q4_K_M.gguf",)  # the default


def test_a_split_gguf_is_its_parts_in_order_and_only_whole() -> None:
    assert pick_files(FILES, "Q6_K", "o/r") == (
        "big/model-Q6_K-00001-of-00002.gguf",
        "big/model-Q6_K-00002-of-00002.gguf",
    )
    with pytest.raises(ModelRefNotFound, match="00002-of-00002"):
        pick_files(FILES[:-2] + FILES[-1:], "Q6_K", "o/r")


def test_no_or_several_matches_name_the_model_files_there() -> None:
    with pytest.raises(ModelRefNotFound) as none:
        pick_files(FILES, "Q5_K_M", "o/r")
    assert "model-Q4_K_S.gguf" in none.value.message
    assert "mmproj" not in none.value.message and "README" not in none.value.message
    with pytest.raises(ModelRefNotFound, match="several"):
        pick_files([*FILES, "other-Q4_K_M.gguf"], "Q4_K_M", "o/r")


def test_without_a_default_file_the_only_model_is_taken() -> None:
    assert pick_files(["x-f16.gguf", "mmproj.gguf"], None, "o/r") == ("x-f16.gguf",)
    with pytest.raises(ModelRefNotFound):
        pick_files(["x-f16.gguf", "x-bf16.gguf"], None, "o/r")


def _manifest() -> Manifest:
    files = (FileHash("m-00001-of-00002.gguf", 4096, 1024, "cd" * 32),)
    files += (FileHash("m-00002-of-00002.gguf", 2048, 512, "dd" * 32),)
    tensors = (TensorHash("t", 1024, 100, "ef" * 32), TensorHash("u", 512, 100, "ef" * 32, 1))
    return Manifest("ab" * 32, files, tensors)


def test_a_manifest_round_trips_and_refuses_what_is_malformed() -> None:
    m = _manifest()
    assert parse_manifest(m.to_json()) == m
    assert parse_manifest(m.to_json()).digest() == m.digest()
    assert m.size == 4096 + 2048
    text = m.to_json()
    outside = text.replace('"t",0,1024,100', '"t",0,4090,100')
    before_data = text.replace('"u",1,512,100', '"u",1,100,100')
    no_part = text.replace('"u",1,512', '"u",2,512')
    for bad in ("{", "[]", text.replace(",4096,", ",-1,"), outside, before_data, no_part):
        with pytest.raises(ModelSourceError):
            parse_manifest(bad)


def test_hashes_learned_on_first_fetch_fill_only_unknown_ones() -> None:
    m = _manifest()
    unknown = replace(m, tensors=(m.tensors[0], replace(m.tensors[1], blake3=None)))
    assert parse_manifest(unknown.to_json()) == unknown  # null: not known yet
    assert unknown.layout_digest() == m.layout_digest() != unknown.digest()
    filled = unknown.with_hashes({"u": "aa" * 32, "t": "bb" * 32})
    assert [t.blake3 for t in filled.tensors] == ["ef" * 32, "aa" * 32]
    book = ManifestBook()
    assert book.learn(unknown, {"u": "11" * 32}) == {"u": "11" * 32}
    assert book.learn(unknown, {"u": "22" * 32, "t": "33" * 32}) == {
        "u": "11" * 32,  # the first told is kept
        "t": "ef" * 32,  # the tracker's own
    }
    assert parse_manifest(book.with_learned(unknown.to_json())).tensors[1].blake3 == "11" * 32
    with pytest.raises(RequestError):
        book.learn(unknown, {"nope": "11" * 32})


def test_learned_hashes_outlive_a_tracker_restart(tmp_path: Path) -> None:
    m = _manifest()
    unknown = replace(m, tensors=(m.tensors[0], replace(m.tensors[1], blake3=None)))
    ManifestBook(tmp_path).learn(unknown, {"u": "11" * 32})
    with (tmp_path / f"{m.fingerprint}.jsonl").open("a") as fh:
        fh.write('["u", "2')  # a write torn by a crash
    again = ManifestBook(tmp_path)  # restarted
    assert again.learn(unknown, {"u": "33" * 32}) == {"u": "11" * 32}
    assert parse_manifest(again.with_learned(unknown.to_json())).tensors[1].blake3 == "11" * 32


def test_a_manifest_signed_for_one_node_is_refused_by_another() -> None:
    key_a, key_b, digest = "11" * 32, "22" * 32, _manifest().digest()
    mac = manifest_mac(key_a, "node-a", digest)
    verify_manifest(key_a, "node-a", digest, mac)
    with pytest.raises(Unauthenticated):
        verify_manifest(key_b, "node-b", digest, mac)
    with pytest.raises(Unauthenticated):
        verify_manifest(key_a, "node-a", "00" * 32, mac)


def test_a_disk_without_room_is_refused_before_a_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda _: usage(100, 90, 10))
    with pytest.raises(DiskFull):
        check_room(tmp_path, 11)
    check_room(tmp_path, 10)
