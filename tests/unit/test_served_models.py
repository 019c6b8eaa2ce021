"""Several models per tracker, the pure parts: the served set (names, aliases a replacement
leaves, draining, what /v1/models lists), the checks of a serve's node assignment, the
choice of empty nodes, a session's recorded model, and a node's unload (T3 to empty)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from node_records import node_record as node

from meshnet.errors import (
    LayerRangeError,
    ModelNotFound,
    NoRoute,
    NotFound,
    RequestError,
    ShardMismatch,
)
from meshnet.layer_range import LayerRange
from meshnet.model.info import load_model_info
from meshnet.model.layer_bytes import LayerBytes, model_layer_bytes
from meshnet.node.service import NodeService
from meshnet.node.tiers import Unload, parse
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.serving.model_admin import check_assignments, choose_assignments, model_json
from meshnet.tracker.serving.placement import Load
from meshnet.tracker.serving.served import MAX_MODELS, ModelState, ServedModel, ServedModels
from meshnet.tracker.serving.served_store import ServedRow, ServedStore
from meshnet.tracker.session_data.session_models import SessionModels
from meshnet.tracker.storage.database import open_database

# --- the served set ----------------------------------------------------------------------


@dataclass
class _Info:
    name: str
    fingerprint: str


@dataclass
class _Routes:
    complete: bool = True

    def route(self) -> tuple[str, ...]:
        if not self.complete:
            raise NoRoute("layer 2 is not served")
        return ("hop",)


@dataclass
class _Tracker:
    planner: _Routes


def served(name: str, complete: bool = True, fingerprint: str = "") -> ServedModel:
    info, tracker = _Info(name, fingerprint or name * 4), _Tracker(_Routes(complete))
    return ServedModel(cast(Any, info), cast(Any, tracker), cast(Any, None), "")


def test_a_request_finds_its_model_and_an_unknown_one_is_404() -> None:
    models = ServedModels(served("a"))
    models.add(served("b"))
    assert models.for_request("b").name == "b"
    with pytest.raises(ModelNotFound):
        models.for_request("c")
    with pytest.raises(NotFound):
        models.get("c")


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (served("a", fingerprint="x"), "named 'a'"),
        (served("z", fingerprint="aaaa"), "already served as"),
    ],
)
def test_a_name_or_a_file_served_twice_is_refused(other: ServedModel, words: str) -> None:
    models = ServedModels(served("a"))
    with pytest.raises(RequestError, match=words):
        models.add(other)
    assert [m.name for m in models] == ["a"]


def test_the_number_of_models_is_bounded() -> None:
    models = ServedModels(served("m0"))
    for i in range(1, MAX_MODELS):
        models.add(served(f"m{i}"))
    with pytest.raises(RequestError, match="release one first"):
        models.add(served("one-more"))


def test_only_serving_models_with_a_complete_route_are_listed() -> None:
    models = ServedModels(served("a"))
    models.add(served("b", complete=False))
    models.add(served("c"))
    models.drain("c")
    assert [m.name for m in models.listed()] == ["a"]


def test_a_draining_model_takes_no_new_request() -> None:
    models = ServedModels(served("a"))
    models.add(served("b"))
    models.drain("b")
    assert models.get("b").state is ModelState.DRAINING
    with pytest.raises(ModelNotFound):
        models.for_request("b")
    assert models.for_request("b", draining=True).name == "b"
    with pytest.raises(RequestError, match="draining already"):
        models.drain("b")


def test_a_replaced_name_leads_to_its_replacement_through_chains() -> None:
    models = ServedModels(served("a"))
    models.add(served("b"))
    models.drain("a", replaced_by="b")
    models.forget("a")
    assert models.for_request("a").name == "b"
    models.add(served("c"))
    models.drain("b", replaced_by="c")
    models.forget("b")
    assert models.for_request("a").name == "c" and models.for_request("b").name == "c"
    assert models.first.name == "c"  # whole-tracker views follow the first model
    models.add(served("a", fingerprint="new"))  # served anew, a name is taken back
    assert models.for_request("a").info.fingerprint == "new"
    assert models.for_request("b").name == "c"
    with pytest.raises(RequestError, match="served already"):
        models.add(served("c", fingerprint="other"))


def test_a_recorded_replacement_is_restored_over_a_model_of_that_name() -> None:
    models = ServedModels(served("a"))
    models.add(served("b"))
    assert models.restore_alias("a", "b")  # "a" came from a flag; it was replaced since
    assert not models.holds("a") and models.for_request("a").name == "b"
    assert models.first.name == "b"
    assert models.restore_alias("old", "b") and models.for_request("old").name == "b"
    assert not models.restore_alias("gone", "nowhere")  # its replacement is not served
    with pytest.raises(ModelNotFound):
        models.for_request("gone")


def test_the_first_model_released_leaves_the_oldest_one_left() -> None:
    models = ServedModels(served("a"))
    models.add(served("b"))
    models.drain("a")
    models.forget("a")
    assert models.first.name == "b"


# --- a serve's node assignment -----------------------------------------------------------


NODES = [node("n1"), node("n2"), node("busy", "0:4"), node("dead", up=False), node("n0")]


def assign(*pairs: tuple[str, str]) -> list[Load]:
    return [Load(n, LayerRange.parse(r)) for n, r in pairs]


def test_an_assignment_covering_the_layers_once_on_empty_nodes_passes() -> None:
    check_assignments(assign(("n2", "2:4"), ("n1", "0:2")), NODES, 4)


@pytest.mark.parametrize(
    ("pairs", "words"),
    [
        ((), "at least one node"),
        ((("n1", "0:2"), ("n1", "2:4")), "named twice"),
        ((("ghost", "0:4"),), "no node 'ghost'"),
        ((("dead", "0:4"),), "is down"),
        ((("busy", "0:4"),), "not empty"),
        ((("n1", "0:2"), ("n2", "3:4")), "layer 2 exactly once"),
        ((("n1", "0:3"), ("n2", "2:4")), "layer 3 exactly once"),
        ((("n1", "0:3"),), "end at layer 3"),
        ((("n1", "1:4"),), "layer 0 exactly once"),
    ],
)
def test_a_bad_assignment_is_refused_with_the_reason(
    pairs: tuple[tuple[str, str], ...], words: str
) -> None:
    with pytest.raises(RequestError, match=words):
        check_assignments(assign(*pairs), NODES, 4)


def test_an_assignment_that_empties_a_node_is_refused_as_a_request_error() -> None:
    # Load's span is None where placement empties a node: a plan to serve has none.
    with pytest.raises(RequestError, match="n1 is given no layers"):
        check_assignments((Load("n1", None),), NODES, 4)


def _sizes(layers: tuple[int, ...], embedding: int = 0, tied: bool = False) -> LayerBytes:
    return LayerBytes(layers, embedding, head=0, shared=0, tied_head=tied, kv_layer_token=0)


def test_empty_nodes_are_chosen_in_id_order_with_equal_layers_split_evenly() -> None:
    chosen = choose_assignments(NODES, _sizes((10,) * 5), 2)
    assert chosen == assign(("n0", "0:3"), ("n1", "3:5"))
    check_assignments(chosen, NODES, 5)


def test_the_layers_are_split_by_their_bytes() -> None:
    # A tied embedding as heavy as three layers sits on the first and the last node.
    chosen = choose_assignments(NODES, _sizes((10,) * 9, embedding=30, tied=True), 3)
    assert chosen == assign(("n0", "0:2"), ("n1", "2:7"), ("n2", "7:9"))


@pytest.mark.parametrize(
    ("count", "words"), [(4, "3 are up"), (0, "must be in"), (6, "must be in")]
)
def test_too_few_empty_nodes_or_a_bad_count_is_refused(count: int, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        choose_assignments(NODES, _sizes((10,) * 5), count)


def test_the_admin_view_lists_each_nodes_bytes(tiny_path: Path) -> None:
    info = load_model_info(tiny_path)
    sizes = model_layer_bytes(info.file, info.spec)
    fp = info.fingerprint
    nodes = [node("a", "0:3", fingerprint=fp), node("b", "3:4", fingerprint=fp), node("c")]
    tracker = cast(Any, _Tracker(_Routes()))
    tracker.generations = list
    view = model_json(ServedModel(info, tracker, cast(Any, None), ""), nodes)
    assert view["bytes"] == sizes.total
    held = {n["node_id"]: n["bytes"] for n in cast(list[dict[str, Any]], view["nodes"])}
    assert held == {
        "a": sizes.range_bytes(LayerRange(0, 3)),
        "b": sizes.range_bytes(LayerRange(3, 4)),
    }


# --- sessions' models ---------------------------------------------------------------------


def test_a_session_is_on_the_model_it_was_bound_to(tmp_path: Path) -> None:
    from meshnet.tracker.session_data.session_store import SessionStore

    db = open_database(tmp_path / "t.db")
    SessionStore(db)  # the turns table the conversation is read from
    bound = SessionModels(db)
    assert bound.model_of("s1") is None  # opened before models were recorded: the first
    bound.bind("s1", "a")
    bound.bind("s1", "b")  # rebased onto a replacement
    assert bound.model_of("s1") == "b"
    assert bound.conversation("s1") == []
    assert bound.purge_orphans(10) == 1  # no session s1 is kept: its row goes
    assert bound.model_of("s1") is None
    db.close()


def test_the_served_set_is_recorded_with_its_replacements(tmp_path: Path) -> None:
    db = open_database(tmp_path / "t.db")
    record = ServedStore(db)
    record.served("b", "/m/b.gguf", "/n/b.gguf")
    record.replaced(ServedRow("a", "/m/a.gguf", "", None), "b")
    record.served("c", "/m/c.gguf", "/m/c.gguf")
    record.replaced(ServedRow("b", "/m/b.gguf", "/n/b.gguf", None), "c")  # a chain
    rows = {r.name: r for r in ServedStore(db).rows()}  # as a restarted tracker reads it
    assert rows["a"].replaced_by == "c" and rows["b"].replaced_by == "c"
    assert rows["c"] == ServedRow("c", "/m/c.gguf", "/m/c.gguf", None)
    record.released("c")
    assert record.rows() == []  # nothing leads to a released model
    db.close()


# --- a node's unload ------------------------------------------------------------------------


def test_a_load_with_no_path_and_no_layers_is_an_unload() -> None:
    assert parse(pb.ConfigureRequest(load=pb.LoadShard()), "/m.gguf") == Unload()
    with pytest.raises(LayerRangeError):  # a path with no layers is still a bad range
        parse(pb.ConfigureRequest(load=pb.LoadShard(model_path="/m.gguf")), None)


def test_an_unload_empties_the_node_and_a_check_changes_nothing(service: NodeService) -> None:
    service.engine.sessions.open("s", 1).result(5)
    unload = pb.ConfigureRequest(load=pb.LoadShard(), check_only=True)
    checked = service.Configure(unload, None)  # type: ignore[arg-type]
    assert not checked.applied and not checked.HasField("failure")
    assert service.engine.stats().loaded
    reply = service.Configure(pb.ConfigureRequest(load=pb.LoadShard()), None)  # type: ignore[arg-type]
    assert reply.applied and reply.tier == "t3" and reply.sessions_ended == 1
    assert reply.fingerprint == "" and not service.engine.stats().loaded
    with pytest.raises(ShardMismatch):
        service.engine.sessions.open("t", 1).result(5)


# --- a node's doctor against a tracker of several models -----------------------------------


def test_the_doctor_accepts_any_model_the_tracker_serves() -> None:
    from meshnet.node.preflight.model import ModelFacts
    from meshnet.node.preflight.tracker import check_served_model

    facts = ModelFacts(Path("/m/tiny-b.gguf"), cast(Any, None), "bb" * 32, 0)
    models = [{"name": "a", "fingerprint": "aa" * 32}, {"name": "tiny-b", "fingerprint": "bb" * 32}]
    health = {"model": "a", "models": models}
    assert not check_served_model(health, facts).failed
    other = ModelFacts(Path("/m/c.gguf"), cast(Any, None), "cc" * 32, 0)
    failed = check_served_model(health, other)
    assert failed.failed and "'a', 'tiny-b'" in failed.detail
