"""Sessions' turns on the model each session is on (several models per tracker).

``ModelTurns`` is the outbox's ``TurnRunner``: it finds the model a session's
turn runs on (the one it was opened on, or what replaced it: ``ServedModels``)
and hands the turn to that model's runner. A session whose model was replaced
is *rebased* for its next turn: its token history (in the old vocabulary) is
set aside and the turn re-prefills the whole conversation, as text, rendered
with the new model's template (``ModelRunner.input_ids``); once the turn is
done the session is on the new model. The turn reports ``resume_path:
"reprefill"`` and ``rebased_from``. A session whose model was released with no
replacement gets ``ModelNotFound`` (404): it cannot go on, its history is kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshnet.model.chat import ChatMessage
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.served import ServedModel, ServedModels
from meshnet.tracker.session_data.records import SessionRecord, TurnRecord
from meshnet.tracker.session_data.session_models import SessionModels
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore
from meshnet.tracker.sessions.turns import OnToken, TurnOutcome, TurnRunner


class ModelRunner(TurnRunner):
    """The turns of one model. A session with completed turns and no token history was
    rebased onto this model: its first turn here feeds the whole conversation."""

    def __init__(
        self, tracker: Tracker, store: SessionStore, snapshots: SnapshotStore, bound: SessionModels
    ) -> None:
        super().__init__(tracker, store, snapshots)
        self._bound = bound

    def input_ids(self, session: SessionRecord, content: str) -> list[int]:
        if session.history:
            return super().input_ids(session, content)
        before = self._bound.conversation(session.id)
        if not before:
            return super().input_ids(session, content)  # a new session's first turn
        model = self.tracker.model
        system = [] if session.system is None else [ChatMessage("system", session.system)]
        text = model.template.render([*system, *before, ChatMessage("user", content)])
        return model.tokenizer.encode(text)


class ModelTurns(TurnRunner):
    """Dispatches each session's turns to the runner of its model (one per model)."""

    def __init__(
        self,
        models: ServedModels,
        bound: SessionModels,
        store: SessionStore,
        snapshots: SnapshotStore,
    ) -> None:
        super().__init__(models.first.tracker, store, snapshots)
        self.models = models
        self.bound = bound
        self._runners: dict[str, ModelRunner] = {}

    def runner(self, model: ServedModel) -> ModelRunner:
        runner = self._runners.get(model.name)
        if runner is None or runner.tracker is not model.tracker:
            runner = ModelRunner(model.tracker, self.store, self.snapshots, self.bound)
            self._runners[model.name] = runner
        runner.owner_of = self.owner_of  # whose sessions are whose is the same on every model
        return runner

    def placed(self, session: SessionRecord) -> tuple[ServedModel, SessionRecord, str | None]:
        """The model the session's next turn runs on, the session as that model sees
        it, and the model it was rebased from (None when it was not)."""
        on = self.bound.model_of(session.id) or self.models.first_name
        model = self.models.for_request(on)  # a released one: ModelNotFound
        if model.name == on:
            return model, session, None
        rebased = replace(session, history=[], tail=[], closed=False, route=(), snapshot_id=None)
        return model, rebased, on

    def input_ids(self, session: SessionRecord, content: str) -> list[int]:
        model, placed, _ = self.placed(session)
        return self.runner(model).input_ids(placed, content)

    def check(
        self, session: SessionRecord, request: dict[str, Any]
    ) -> tuple[list[int], SamplingParams]:
        model, placed, _ = self.placed(session)
        return self.runner(model).check(placed, request)

    async def run(
        self, session: SessionRecord, turn: TurnRecord, on_token: OnToken | None = None
    ) -> TurnOutcome:
        model, placed, rebased_from = self.placed(session)
        outcome = await self.runner(model).run(placed, turn, on_token)
        if rebased_from is not None:
            self.bound.bind(session.id, model.name)
            result = {**outcome.result, "resume_path": "reprefill", "rebased_from": rebased_from}
            return TurnOutcome(result, outcome.session)
        return outcome
