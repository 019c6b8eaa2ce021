"""Model references against a local hub (``tests/hub_server.py``) with the real
``huggingface_hub`` client: what is located, what a node fetches of its layers, what is
refused, and that a stopped fetch resumes."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import blake3
import numpy as np
import pytest
from hub_models import N_LAYERS, Q4_PARTS, Q8, REPO, q4_size, unsplit_q4, write_hub
from hub_server import HubServer

from meshnet.auth.keys import new_secret
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.backends.base import BatchEntry
from meshnet.backends.shard import load_shard_file
from meshnet.errors import DiskFull, FetchFailed, HashMismatch, ModelRefNotFound
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import free_port
from meshnet.model.gguf_file import open_gguf
from meshnet.model.gguf_split import split_fingerprint
from meshnet.model.layer_bytes import range_holds
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.manifest import Manifest
from meshnet.model_source.peers import Peer, scope
from meshnet.model_source.reference import parse_ref
from meshnet.model_source.remote import locate
from meshnet.model_source.shard_store import fetch_shard, shard_path, shard_paths
from meshnet.model_source.tracker_source import tracker_model
from meshnet.model_source.whole import local_model_path
from meshnet.node.kv_offers import KVOffers
from meshnet.node.model_fetch import NodeModels


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(write_hub(tmp_path_factory.mktemp("hub"))) as server:
        yield server


def _cfg(hub: HubServer, tmp: Path, client: str) -> SourceConfig:
    return SourceConfig(
        cache_dir=tmp / f"cache-{client}",
        client=client,
        endpoint=hub.url,
        hf_cache=tmp / "hf",
        backoff_s=0.01,
        chunk_bytes=64 << 10,
    )


def _file(hub: HubServer, name: str) -> Path:
    return hub.root / REPO / name


def _whole(hub: HubServer) -> Path:
    """The split Q4_K_M as one file: what a fetched shard computes as."""
    return unsplit_q4(hub.root)


def test_a_quantization_picks_its_file_and_the_sha256_is_the_hubs(
    hub: HubServer, tmp_path: Path
) -> None:
    model = locate(parse_ref(f"hf:{REPO}:q8_0"), _cfg(hub, tmp_path, "t"))
    assert [f.name for f in model.files] == [Q8]
    assert model.files[0].sha256 == hub.sha256(_file(hub, Q8))
    default = locate(parse_ref(f"hf:{REPO}"), _cfg(hub, tmp_path, "t"))
    assert [f.name for f in default.files] == list(Q4_PARTS)  # a split GGUF's parts
    by_part = locate(parse_ref(f"hf:{REPO}/{Q4_PARTS[1]}"), _cfg(hub, tmp_path, "t"))
    assert [f.name for f in by_part.files] == list(Q4_PARTS)
    assert by_part.fingerprint == split_fingerprint([hub.sha256(_file(hub, p)) for p in Q4_PARTS])


def test_missing_things_are_typed_errors_naming_the_files_there(
    hub: HubServer, tmp_path: Path
) -> None:
    cfg = _cfg(hub, tmp_path, "t")
    with pytest.raises(ModelRefNotFound) as quant:
        locate(parse_ref(f"hf:{REPO}:Q5_K_S"), cfg)
    assert Q4_PARTS[0] in quant.value.message and Q8 in quant.value.message
    with pytest.raises(ModelRefNotFound) as file:
        locate(parse_ref(f"hf:{REPO}/nope.gguf"), cfg)
    assert Q4_PARTS[0] in file.value.message
    with pytest.raises(ModelRefNotFound, match="no such repository"):
        locate(parse_ref("hf:test/absent"), cfg)
    with pytest.raises(ModelRefNotFound, match=r"no \.gguf file"):
        locate(parse_ref("hf:test/empty"), cfg)


def test_a_whole_file_lands_in_the_hub_cache_byte_for_byte(hub: HubServer, tmp_path: Path) -> None:
    path = local_model_path(f"hf:{REPO}:Q8_0", _cfg(hub, tmp_path, "whole"))
    assert path.read_bytes() == _file(hub, Q8).read_bytes()
    assert str(tmp_path / "hf") in str(path)  # huggingface_hub's cache layout
    url = f"{hub.url}/{REPO}/resolve/main/{Q8}"
    by_url = local_model_path(url, _cfg(hub, tmp_path, "url"))
    assert by_url.read_bytes() == _file(hub, Q8).read_bytes()


def test_a_split_model_lands_whole_and_loads_as_the_unsplit_file(
    hub: HubServer, tmp_path: Path
) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/{Q4_PARTS[0]}"
    for ref, client in ((f"hf:{REPO}:Q4_K_M", "whole"), (url, "url")):
        first = local_model_path(ref, _cfg(hub, tmp_path, client))
        assert first.name == Q4_PARTS[0]
        for part in Q4_PARTS:
            assert (first.parent / part).read_bytes() == _file(hub, part).read_bytes()
        layers, ids = LayerRange(0, N_LAYERS), np.array([3, 1, 4, 1, 5])
        assert np.array_equal(_forward(first, layers, ids), _forward(_whole(hub), layers, ids))


def _forward(path: Path, layers: LayerRange, x: np.ndarray) -> np.ndarray:
    shard = load_shard_file(str(path), layers, "numpy")
    return shard.forward(x, [BatchEntry(shard.backend.new_kv(), len(x))])


def test_a_node_fetches_only_its_layers_and_computes_as_the_whole_file(
    hub: HubServer, tmp_path: Path
) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    tracked = tracker_model(ref, _cfg(hub, tmp_path, "tracker"))
    size = q4_size(hub.root)
    shas = [hub.sha256(_file(hub, p)) for p in Q4_PARTS]
    assert tracked.manifest.fingerprint == split_fingerprint(shas)  # the hub's, unread
    assert 0 < hub.sent["tracker"] < 0.1 * size  # its headers (64 KiB reads), no tensor
    info = open_gguf(tracked.path)
    assert info.value("llama.block_count") == N_LAYERS  # the header, kept
    cfg = _cfg(hub, tmp_path, "node-a")
    model = locate(parse_ref(ref), cfg)
    half = LayerRange(0, N_LAYERS // 2)
    shard = fetch_shard(model, tracked.manifest, half, cfg)
    assert hub.sent["node-a"] == shard.fetched_bytes
    assert shard.fetched_bytes < 0.6 * size
    parts = shard_paths(cfg, tracked.manifest.fingerprint, half, len(Q4_PARTS))
    assert shard.path == parts[0] and all(p.is_file() for p in parts)
    disk = sum(p.stat().st_blocks * 512 for p in parts)
    assert disk < 0.7 * size  # sparse: holes take no disk
    ids = np.array([5, 9, 40, 3])
    assert np.array_equal(_forward(shard.path, half, ids), _forward(_whole(hub), half, ids))
    again = fetch_shard(model, tracked.manifest, half, cfg)  # kept: read nothing
    assert again.fetched_bytes == 0 and hub.sent["node-a"] == shard.fetched_bytes
    # Trust on first fetch: the tracker read no tensor of the range; the node hashed each.
    unknown = {t.name for t in tracked.manifest.tensors if t.blake3 is None}
    read = {n for n in unknown if range_holds(n, half, N_LAYERS, tied_head=False)}
    assert set(shard.learned) == read
    blk = tracked.manifest.by_name()["blk.0.attn_q.weight"]
    with _file(hub, Q4_PARTS[blk.part]).open("rb") as fh:
        fh.seek(blk.offset)
        assert shard.learned[blk.name] == blake3.blake3(fh.read(blk.nbytes)).hexdigest()


def _learned(hub: HubServer, tmp: Path, ref: str, layers: LayerRange) -> Manifest:
    """The tracker's manifest of ``ref`` with the hashes a first clean fetch of ``layers``
    learned, as the tracker records them."""
    manifest = tracker_model(ref, _cfg(hub, tmp, "tracker")).manifest
    cfg = _cfg(hub, tmp, "first")
    first = fetch_shard(locate(parse_ref(ref), cfg), manifest, layers, cfg)
    return manifest.with_hashes(first.learned)


class _Ledger:
    """A tracker's record of learned hashes, in this process (``first_fetch.Ledger``)."""

    def __init__(self, held: dict[str, str]) -> None:
        self.held, self.told, self.asked = held, dict[str, str](), set[str]()

    def recorded(self, name: str) -> str | None:
        self.asked.add(name)
        return self.held.get(name)

    def report(self, name: str, digest: str) -> str | None:
        self.told[name] = digest
        return self.held.setdefault(name, digest)


def test_a_corrupted_byte_is_refused_by_hash_and_fetched_again(
    hub: HubServer, tmp_path: Path
) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    layers = LayerRange(N_LAYERS // 2, N_LAYERS)
    manifest = _learned(hub, tmp_path, ref, layers)
    cfg = _cfg(hub, tmp_path, "node-c")
    target = manifest.by_name()[f"blk.{N_LAYERS - 1}.ffn_down.weight"]
    assert target.part == 2  # the last part's
    hub.corrupt(f"{REPO}/{Q4_PARTS[2]}", target.offset + 100)
    shard = fetch_shard(locate(parse_ref(ref), cfg), manifest, layers, cfg)
    assert shard.fetched_bytes == hub.sent["node-c"]
    whole = _file(hub, Q4_PARTS[2]).read_bytes()
    kept = shard_paths(cfg, manifest.fingerprint, layers, len(Q4_PARTS))[2]
    with kept.open("rb") as fh:
        fh.seek(target.offset)
        assert fh.read(target.nbytes) == whole[target.offset : target.end]
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    assert np.array_equal(_forward(shard.path, layers, x), _forward(_whole(hub), layers, x))


def test_a_first_fetch_whose_bytes_are_not_the_first_nodes_is_fetched_again(
    hub: HubServer, tmp_path: Path
) -> None:
    """Trust on first fetch: a node told, when it reports, that another node's hash came
    first fetches the tensor again and checks it against that one."""
    ref = f"hf:{REPO}:Q4_K_M"
    layers = LayerRange(0, 1)
    truth = _learned(hub, tmp_path, ref, layers)
    manifest = tracker_model(ref, _cfg(hub, tmp_path, "tracker")).manifest  # none learned
    target = manifest.by_name()["blk.0.ffn_up.weight"]
    ledger = _Ledger({target.name: str(truth.by_name()[target.name].blake3)})
    hub.corrupt(f"{REPO}/{Q4_PARTS[0]}", target.offset + 7)
    cfg = _cfg(hub, tmp_path, "node-t")
    shard = fetch_shard(locate(parse_ref(ref), cfg), manifest, layers, cfg, ledger=ledger)
    assert ledger.told[target.name] != ledger.held[target.name]  # the corrupted bytes' hash
    assert target.name not in shard.learned  # checked against the first node's instead
    ids = np.array([2, 7])
    assert np.array_equal(_forward(shard.path, layers, ids), _forward(_whole(hub), layers, ids))


def test_a_fetching_peer_whose_hashes_never_come_is_waited_on_once(
    hub: HubServer, tmp_path: Path
) -> None:
    """A single flight whose first node never reports: the second waits (bounded) for
    one tensor's hash, then takes the rest from the hub without waiting again."""
    ref = f"hf:{REPO}:Q4_K_M"
    layers = LayerRange(0, 2)
    manifest = tracker_model(ref, _cfg(hub, tmp_path, "tracker")).manifest
    holder_cfg = _cfg(hub, tmp_path, "holder")
    fetch_shard(locate(parse_ref(ref), holder_cfg), manifest, layers, holder_cfg)
    keys = MeshKeys(new_secret())
    holder = NodeModels("http://unused", "holder", keys.node_key("holder"), holder_cfg)
    offers = KVOffers("127.0.0.1", "127.0.0.1", shards=holder.serve_peer)
    try:
        token = keys.peer("holder", "node-g", "pull", scope(manifest.fingerprint))
        stalled = Peer("holder", offers.address, layers, token, fetching=True)
        ledger = _Ledger({})
        cfg = replace(_cfg(hub, tmp_path, "node-g"), peer_wait_s=0.3)
        model = locate(parse_ref(ref), cfg)
        shard = fetch_shard(model, manifest, layers, cfg, peers=[stalled], ledger=ledger)
    finally:
        offers.close()
    assert len(ledger.asked) == 1 and set(ledger.told) == set(shard.learned)
    assert shard.from_peers == sum(f.header_bytes for f in manifest.files)  # headers only
    assert hub.sent["node-g"] == shard.fetched_bytes - shard.from_peers


def test_a_hash_that_never_matches_is_typed_and_leaves_nothing(
    hub: HubServer, tmp_path: Path
) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    layers = LayerRange(0, 1)
    manifest = _learned(hub, tmp_path, ref, layers)
    cfg = replace(_cfg(hub, tmp_path, "node-h"), attempts=2)
    target = manifest.by_name()["blk.0.attn_q.weight"]
    hub.corrupt(f"{REPO}/{Q4_PARTS[0]}", target.offset, times=2)  # each of the two tries
    with pytest.raises(HashMismatch):
        fetch_shard(locate(parse_ref(ref), cfg), manifest, layers, cfg)
    path = shard_path(cfg, manifest.fingerprint, layers, len(Q4_PARTS))
    assert not [p for p in path.parent.iterdir() if not p.name.endswith(".lock")]


def test_an_interrupted_fetch_resumes_where_it_stopped(hub: HubServer, tmp_path: Path) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    manifest = tracker_model(ref, _cfg(hub, tmp_path, "tracker")).manifest
    cfg = replace(_cfg(hub, tmp_path, "node-r"), attempts=1)
    layers = LayerRange(0, N_LAYERS // 2)
    model = locate(parse_ref(ref), cfg)
    clean = _cfg(hub, tmp_path, "node-clean")
    needed = fetch_shard(model, manifest, layers, clean).fetched_bytes
    hub.cut_after(300_000)
    try:
        with pytest.raises(FetchFailed):
            fetch_shard(model, manifest, layers, cfg)
    finally:
        hub.cut_after(None)
    first = hub.sent["node-r"]
    assert 0 < first <= 300_000
    shard = fetch_shard(model, manifest, layers, cfg)
    assert hub.sent["node-r"] == first + shard.fetched_bytes
    # Nothing fetched twice but what the cut chunk had begun (one chunk at most).
    assert needed - first <= shard.fetched_bytes < needed - first + cfg.chunk_bytes
    ids = np.array([7, 1, 2])
    assert np.array_equal(_forward(shard.path, layers, ids), _forward(_whole(hub), layers, ids))


def test_a_full_disk_is_typed_and_leaves_nothing(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    manifest = tracker_model(ref, _cfg(hub, tmp_path, "tracker")).manifest
    cfg = _cfg(hub, tmp_path, "node-d")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda _: usage(1 << 20, 1 << 20, 1000))
    layers = LayerRange(0, 2)
    with pytest.raises(DiskFull):
        fetch_shard(locate(parse_ref(ref), cfg), manifest, layers, cfg)
    path = shard_path(cfg, manifest.fingerprint, layers, len(Q4_PARTS))
    assert not [p for p in path.parent.iterdir() if not p.name.endswith(".lock")]
    assert hub.sent["node-d"] < 64 << 10  # the header at most: refused before the tensors


def test_a_wider_range_fetches_only_what_it_adds(hub: HubServer, tmp_path: Path) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    manifest = tracker_model(ref, _cfg(hub, tmp_path, "tracker")).manifest
    cfg = _cfg(hub, tmp_path, "node-w")
    model = locate(parse_ref(ref), cfg)
    fetch_shard(model, manifest, LayerRange(0, 4), cfg)
    before = hub.sent["node-w"]
    wider = fetch_shard(model, manifest, LayerRange(0, 6), cfg)
    added = hub.sent["node-w"] - before
    by_name = manifest.by_name()
    blk = [t for t in manifest.tensors if t.name.startswith(("blk.4.", "blk.5."))]
    assert added == wider.fetched_bytes == sum(t.nbytes for t in blk)
    assert wider.from_disk >= sum(by_name[f"blk.{i}.ffn_up.weight"].nbytes for i in range(4))
    x = np.array([4, 8, 15])
    assert np.array_equal(
        _forward(wider.path, LayerRange(0, 6), x), _forward(_whole(hub), LayerRange(0, 6), x)
    )


def test_a_tracker_without_its_source_serves_what_its_cache_kept(
    hub: HubServer, tmp_path: Path
) -> None:
    ref = f"hf:{REPO}:Q4_K_M"
    cfg = _cfg(hub, tmp_path, "tracker-k")
    first = tracker_model(ref, cfg)
    gone = replace(cfg, endpoint=f"http://127.0.0.1:{free_port()}", attempts=1)
    again = tracker_model(ref, gone)
    assert again.manifest == first.manifest and again.path == first.path
    with pytest.raises(FetchFailed):
        tracker_model(f"hf:{REPO}:Q8_0", gone)  # never kept: nothing to fall back on
