"""Shard bytes between nodes over the bulk port: a node gives bytes of its own shard
files only to a peer token the tracker issued for that model, and only inside them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from meshnet.auth.keys import new_secret
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.layer_range import LayerRange
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.live import LiveFetch
from meshnet.model_source.peers import Peer, PeerNotYet, PeerRefused, read_from_peer, scope
from meshnet.model_source.shard_store import shard_path, shard_paths
from meshnet.node.kv_offers import KVOffers
from meshnet.node.model_fetch import NodeModels
from meshnet.tracker.nodes.inventory import Inventory

FP = "ab" * 32
OTHER = "cd" * 32
LAYERS = LayerRange(0, 2)


@pytest.fixture
def holder(tmp_path: Path) -> tuple[KVOffers, MeshKeys, bytes]:
    keys = MeshKeys(new_secret())
    cfg = SourceConfig(cache_dir=tmp_path)
    data = bytes(range(256)) * 64
    path = shard_path(cfg, FP, LAYERS)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    models = NodeModels("http://unused", "holder", keys.node_key("holder"), cfg)
    return KVOffers("127.0.0.1", "127.0.0.1", shards=models.serve_peer), keys, data


def _peer(offers: KVOffers, token: str, layers: LayerRange = LAYERS) -> Peer:
    return Peer("holder", offers.address, layers, token)


def test_a_peer_token_for_the_model_reads_its_bytes(
    holder: tuple[KVOffers, MeshKeys, bytes],
) -> None:
    offers, keys, data = holder
    try:
        token = keys.peer("holder", "asker", "pull", scope(FP))
        assert read_from_peer(_peer(offers, token), FP, 0, 100, 900) == data[100:1000]
    finally:
        offers.close()


def test_anything_else_is_refused(holder: tuple[KVOffers, MeshKeys, bytes]) -> None:
    offers, keys, data = holder
    try:
        good = keys.peer("holder", "asker", "pull", scope(FP))
        refused = [
            (_peer(offers, keys.peer("holder", "asker", "pull", scope(OTHER))), FP, 0, 10),
            (_peer(offers, keys.peer("holder", "asker", "relay")), FP, 0, 10),
            (_peer(offers, keys.peer("someone-else", "asker", "pull", scope(FP))), FP, 0, 10),
            (_peer(offers, "t1.0.forged"), FP, 0, 10),
            (_peer(offers, good), FP, len(data) - 5, 10),  # past the end of the file
            (_peer(offers, good, LayerRange(0, 3)), FP, 0, 10),  # a shard it does not hold
            (_peer(offers, good), FP, 0, 64 << 20),  # past the bound of one request
        ]
        for peer, fp, offset, length in refused:
            with pytest.raises(PeerRefused):
                read_from_peer(peer, fp, 0, offset, length)
    finally:
        offers.close()


def test_a_kv_ticket_connection_is_unchanged_by_the_shard_requests(
    holder: tuple[KVOffers, MeshKeys, bytes],
) -> None:
    offers, _, _ = holder
    try:  # an unknown 16-byte ticket: closed without a byte, as before
        host, port = offers.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(b"x" * 16)
            assert conn.recv(1) == b""
    finally:
        offers.close()


def test_a_fetch_under_way_gives_only_the_bytes_it_has_checked(tmp_path: Path) -> None:
    """A single flight's first node: a peer asking for bytes it has not checked yet is told
    to ask again; once checked they are given, from the partial file, then the whole one."""
    keys = MeshKeys(new_secret())
    cfg = SourceConfig(cache_dir=tmp_path)
    layers = LayerRange(2, 4)
    paths = shard_paths(cfg, FP, layers, 2)
    paths[0].parent.mkdir(parents=True)
    data = bytes(range(256)) * 16
    partial = paths[1].with_name(paths[1].name + ".partial")
    partial.write_bytes(data)
    models = NodeModels("http://unused", "holder", keys.node_key("holder"), cfg)
    live = LiveFetch(paths)
    models._live[(FP, layers)] = live  # as ``shard`` keeps it while it fetches
    offers = KVOffers("127.0.0.1", "127.0.0.1", shards=models.serve_peer)
    try:
        peer = _peer(offers, keys.peer("holder", "asker", "pull", scope(FP)), layers)
        with pytest.raises(PeerNotYet):
            read_from_peer(peer, FP, 1, 100, 50)
        live.checked(1, 64, 512)
        assert read_from_peer(peer, FP, 1, 100, 50) == data[100:150]
        with pytest.raises(PeerNotYet):  # runs past what is checked
            read_from_peer(peer, FP, 1, 500, 50)
        with pytest.raises(PeerNotYet):  # another part
            read_from_peer(peer, FP, 0, 100, 50)
        partial.replace(paths[1])  # the fetch ended: the whole file is read
        assert read_from_peer(peer, FP, 1, 100, 50) == data[100:150]
    finally:
        offers.close()


def test_the_tracker_names_to_a_fetcher_only_those_that_began_before_it() -> None:
    book, layers = Inventory(), LayerRange(0, 4)
    assert book.fetch_begun("a", "h:1", FP, layers) == []
    (first,) = book.fetch_begun("b", "h:2", FP, layers)
    assert (first.node_id, first.bulk_address, first.layers) == ("a", "h:1", layers)
    assert book.fetch_begun("a", "h:1", FP, layers) == []  # said again: keeps its place
    assert book.fetch_begun("c", "h:3", OTHER, layers) == []  # another model
    assert [f.node_id for f in book.fetch_begun("d", "h:4", FP, LayerRange(2, 6))] == ["a", "b"]
