"""The models one tracker serves, by name: each with its own routes, placement and state.

A served model is a ``ModelInfo`` (name, fingerprint, spec, tokenizer, chat
template), a ``Tracker`` that routes over the nodes holding that fingerprint
(its own route driver; the store, channels, admission, ledger, metrics and the
one ``heal_lock`` are shared with the first model's, so capacity and Configure
calls are the whole tracker's), and a ``Placement`` controller keeping its
ranges covered. Requests name a model; ``for_request`` finds the one to run:

    serving ──release──▶ draining ──(generations done, nodes emptied)──▶ forgotten
       └────replace by B──▶ draining, its name an alias of B from now on

A draining model takes no new request. A replaced model's name stays an alias
of its replacement, so clients (and sessions) that name it reach the new model;
a released model's name is unknown (404) once it drains. ``ServedModels`` is
read and changed on the event loop only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from meshnet.errors import MeshnetError, ModelNotFound, NotFound, RequestError
from meshnet.model.info import ModelInfo
from meshnet.model_source.config import source_config
from meshnet.model_source.whole import local_model_path
from meshnet.tracker.routing.driver import RouteDriver
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.placement import Placement
from meshnet.tracker.trust.verifier import TrustedModel

MAX_MODELS = 16  # served at once: each holds its tokenizer and a placement loop


class ModelState(StrEnum):
    SERVING = "serving"  # new requests route to it
    DRAINING = "draining"  # released or replaced: running generations finish, then it goes


@dataclass
class ServedModel:
    """One model of the tracker. ``node_path``: the file nodes are told to load (as
    they see it; "" for the first model: each node's start model)."""

    info: ModelInfo
    tracker: Tracker
    placement: Placement
    node_path: str
    state: ModelState = ModelState.SERVING
    replaced_by: str | None = None  # the model its name now stands for

    @property
    def name(self) -> str:
        return self.info.name

    def complete(self) -> bool:
        """Whether a complete route of up nodes serves it now."""
        try:
            self.tracker.planner.route()
        except MeshnetError:
            return False
        return True


def model_tracker(first: Tracker, info: ModelInfo, node_path: str) -> Tracker:
    """A ``Tracker`` for another model of the tracker ``first`` runs: its own driver,
    and everything tracker-wide shared with ``first`` (its ``Shared``: one admission,
    one ledger spool, one ``heal_lock``, one metrics registry, one inventory; and one
    placement lease, one trust)."""
    driver = RouteDriver(
        first.channels, info.fingerprint, info.spec, info.tokenizer, first.driver.limits
    )
    tracker = Tracker(first.store, info, first.channels, driver, first.config, first.shared)
    tracker.node_model_path = node_path
    tracker.trusted_nodes = first.trusted_nodes  # trust is tracker-wide too
    tracker.leader = first.leader  # one placement lease for every model's controller
    if first.verification is not None:  # verification is tracker-wide: this model's too
        rate = first.verification.rate
        tracker.verify(TrustedModel(str(whole_file(info))), rate, first.trusted_nodes)
    return tracker


def whole_file(info: ModelInfo) -> Path:
    """The whole GGUF of ``info`` (the verifier runs every layer): its path, or a model by
    reference fetched whole (the tracker keeps only its header otherwise)."""
    if info.ref is None:
        return info.path
    return local_model_path(info.ref, source_config("tracker"))


class ServedModels:
    """The tracker's models by name, and the aliases replaced names left."""

    def __init__(self, first: ServedModel) -> None:
        self.first_name = first.name  # the model sessions without a recorded one are on
        self._models: dict[str, ServedModel] = {first.name: first}
        self._aliases: dict[str, str] = {}  # replaced name -> its replacement

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    @property
    def first(self) -> ServedModel:
        """The model the tracker started with, or what replaced it (whole-tracker
        views — the dashboard, benchmarks — show this one; once it is released, the
        oldest model left). ``ModelNotFound`` when none is left."""
        try:
            return self.for_request(self.first_name, draining=True)
        except ModelNotFound:
            if not self._models:
                raise
            return next(iter(self._models.values()))

    def add(self, model: ServedModel) -> None:
        """Serve ``model``; ``RequestError`` when its name is taken or too many are served.
        A name that led to a replacement is taken back: it names this model from now on."""
        self.check_new(model.info)
        self._aliases.pop(model.name, None)
        self._models[model.name] = model

    def check_new(self, info: ModelInfo) -> None:
        """``RequestError`` unless a model named and fingerprinted so can be added."""
        if info.name in self._models:
            raise RequestError(f"a model named {info.name!r} is served already")
        same = [m.name for m in self._models.values() if m.info.fingerprint == info.fingerprint]
        if same:
            raise RequestError(f"the file of {info.name!r} is already served as {same[0]!r}")
        if len(self._models) >= MAX_MODELS:
            raise RequestError(f"{MAX_MODELS} models are served already: release one first")

    def get(self, name: str) -> ServedModel:
        """The model of that name (any state); ``NotFound`` when none."""
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"no model {name!r} is served here")
        return model

    def for_request(self, name: str, draining: bool = False) -> ServedModel:
        """The model a request naming ``name`` runs on (a replaced name leads to its
        replacement); ``ModelNotFound`` (404) when none, or when it is draining
        (unless ``draining``)."""
        seen = {name}
        while name in self._aliases:
            name = self._aliases[name]
            if name in seen:
                break
            seen.add(name)
        model = self._models.get(name)
        if model is None or (model.state is not ModelState.SERVING and not draining):
            raise ModelNotFound(f"model {name!r} is not served here")
        return model

    def listed(self) -> list[ServedModel]:
        """What ``/v1/models`` lists: the models serving with a complete route now."""
        return [m for m in self._models.values() if m.state is ModelState.SERVING and m.complete()]

    def drain(self, name: str, replaced_by: str | None = None) -> ServedModel:
        """Stop routing new requests to ``name``; with ``replaced_by`` its name (and every
        alias of it) leads there from now on."""
        model = self.get(name)
        if model.state is not ModelState.SERVING:
            raise RequestError(f"model {name!r} is {model.state.value} already")
        model.state = ModelState.DRAINING
        if replaced_by is not None:
            model.replaced_by = replaced_by
            self._aliases[name] = replaced_by
            for alias, target in list(self._aliases.items()):
                if target == name:
                    self._aliases[alias] = replaced_by
        return model

    def restore_alias(self, name: str, target: str) -> bool:
        """Make ``name`` lead to ``target`` again (a replacement recorded before a restart);
        a model served under ``name`` is dropped. False when ``target`` is not served."""
        if target not in self._models or target == name:
            return False
        if name in self._models:
            self.drain(name, replaced_by=target)
            self.forget(name)
        else:
            self._aliases[name] = target
        return True

    def holds(self, name: str) -> bool:
        """Whether a model of that name is held (serving or draining)."""
        return name in self._models

    def forget(self, name: str) -> None:
        """Drop a drained model (its nodes were emptied)."""
        self._models.pop(name, None)

    def serving_fingerprints(self) -> set[str]:
        """The fingerprints of every model held (serving or draining): their nodes are taken."""
        return {m.info.fingerprint for m in self._models.values()}
