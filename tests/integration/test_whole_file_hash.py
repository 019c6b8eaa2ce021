"""A whole file fetched from the hub is checked against the sha256 the hub gives for it
(its LFS pointer) before it lands in the cache under that sha256's name: a hub (or a
mirror, a proxy) serving other bytes is a typed error that caches nothing, and a
resumed download is hashed over all its bytes, the part kept from before included.
Against a local hub (``tests/hub_server.py``) with the real ``huggingface_hub`` client."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hub_models import Q4_PARTS, Q8, REPO, write_hub
from hub_server import COMMIT, HubServer
from huggingface_hub import constants, scan_cache_dir

from meshnet.errors import FetchFailed, HashMismatch
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.whole import local_model_path

Q8_REF = f"hf:{REPO}:Q8_0"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(write_hub(tmp_path_factory.mktemp("hub"))) as server:
        yield server


def _cfg(hub: HubServer, tmp: Path, client: str) -> SourceConfig:
    return SourceConfig(
        cache_dir=tmp / "meshnet",
        client=client,
        endpoint=hub.url,
        hf_cache=tmp / "hf",
        attempts=2,
        backoff_s=0.01,
        chunk_bytes=64 << 10,
    )


def _published(hub: HubServer, name: str) -> bytes:
    return (hub.root / REPO / name).read_bytes()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flipped(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0xFF
    return bytes(out)


def _landed(hf: Path) -> list[Path]:
    """The files of the hub cache that hold or name model bytes (locks and refs aside)."""
    if not hf.is_dir():
        return []
    found = (p for p in hf.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(p for p in found if ".gguf" in p.name or "blobs" in p.parts)


def _ranges(hub: HubServer, client: str, name: str) -> list[str | None]:
    return [r for c, path, r in hub.requests if c == client and path.endswith(f"/{name}")]


def test_a_hub_serving_other_bytes_than_its_sha256_is_refused_and_nothing_lands(
    hub: HubServer, tmp_path: Path
) -> None:
    cfg = _cfg(hub, tmp_path, "liar")
    data, offset = _published(hub, Q8), 5000
    hub.corrupt(f"{REPO}/{Q8}", offset, times=1)
    with pytest.raises(HashMismatch) as refused:
        local_model_path(Q8_REF, cfg)
    message = refused.value.message
    assert Q8 in message and _sha(data) in message and _sha(_flipped(data, offset)) in message
    assert _landed(tmp_path / "hf") == []  # no blob under the sha's name, no partial file
    good = local_model_path(Q8_REF, cfg)  # the hub serves the right bytes again
    assert good.read_bytes() == data
    assert (tmp_path / "hf" / "models--test--tiny" / "blobs" / _sha(data)).is_file()


def test_a_good_fetch_lands_in_the_hub_cache_and_is_found_offline(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(hub, tmp_path, "good")
    path = local_model_path(Q8_REF, cfg)
    assert path.read_bytes() == _published(hub, Q8)
    assert path.parent == tmp_path / "hf" / "models--test--tiny" / "snapshots" / COMMIT
    scan = scan_cache_dir(tmp_path / "hf")  # huggingface_hub's own view of its cache
    assert not scan.warnings and not scan.incomplete_files
    [repo] = scan.repos
    [revision] = repo.revisions
    assert repo.repo_id == REPO and revision.commit_hash == COMMIT and "main" in revision.refs
    assert [f.file_name for f in revision.files] == [Q8]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # huggingface_hub reads its cache
    assert local_model_path(Q8_REF, cfg) == path


def test_a_split_model_with_one_bad_part_keeps_the_good_parts_and_fetches_only_the_bad(
    hub: HubServer, tmp_path: Path
) -> None:
    cfg = _cfg(hub, tmp_path, "split")
    ref = f"hf:{REPO}:Q4_K_M"
    hub.corrupt(f"{REPO}/{Q4_PARTS[2]}", 100, times=1)
    with pytest.raises(HashMismatch, match=Q4_PARTS[2]):
        local_model_path(ref, cfg)
    blobs = tmp_path / "hf" / "models--test--tiny" / "blobs"
    good = [_published(hub, p) for p in Q4_PARTS[:2]]
    assert sorted(p.name for p in blobs.iterdir()) == sorted(_sha(d) for d in good)
    before = hub.sent["split"]
    first = local_model_path(ref, cfg)
    for part in Q4_PARTS:
        assert (first.parent / part).read_bytes() == _published(hub, part)
    assert hub.sent["split"] - before == len(_published(hub, Q4_PARTS[2]))  # the bad one only


def _cut_midway(hub: HubServer, cfg: SourceConfig, tmp: Path, n: int) -> Path:
    """A fetch of the Q8 file that stops after about ``n`` bytes; its partial file."""
    hub.cut_after(n)
    try:
        with pytest.raises(FetchFailed):
            local_model_path(Q8_REF, cfg)
    finally:
        hub.cut_after(None)
    [partial] = (tmp / "hf").rglob("*.incomplete")
    assert [f.file_path for f in scan_cache_dir(tmp / "hf").incomplete_files] == [partial]
    assert 0 < partial.stat().st_size <= n
    return partial


def test_a_resumed_download_continues_where_it_stopped_and_checks_every_byte(
    hub: HubServer, tmp_path: Path
) -> None:
    cfg = _cfg(hub, tmp_path, "resume")
    have = _cut_midway(hub, cfg, tmp_path, 150_000).stat().st_size
    asked = len(_ranges(hub, "resume", Q8))
    path = local_model_path(Q8_REF, cfg)
    assert path.read_bytes() == _published(hub, Q8)
    assert _ranges(hub, "resume", Q8)[asked] == f"bytes={have}-{len(_published(hub, Q8)) - 1}"


def test_a_resumed_download_whose_kept_part_is_corrupt_is_refused_and_nothing_lands(
    hub: HubServer, tmp_path: Path
) -> None:
    cfg = _cfg(hub, tmp_path, "rot")
    data = _published(hub, Q8)
    partial = _cut_midway(hub, cfg, tmp_path, 150_000)
    have = partial.stat().st_size
    kept = partial.read_bytes()
    partial.write_bytes(_flipped(kept, have // 2))  # rotted on disk, or a bad earlier source
    asked = len(_ranges(hub, "rot", Q8))
    with pytest.raises(HashMismatch) as refused:
        local_model_path(Q8_REF, cfg)
    assert _ranges(hub, "rot", Q8)[asked].startswith(f"bytes={have}-")  # resumed, not restarted
    assert _sha(_flipped(data, have // 2)) in refused.value.message
    assert _landed(tmp_path / "hf") == []
    assert local_model_path(Q8_REF, replace(cfg, attempts=5)).read_bytes() == data
