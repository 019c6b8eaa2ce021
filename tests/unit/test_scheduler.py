"""The node's pure batch planner: rows, chunks, budget and refusals, no model needed."""

import numpy as np

from meshnet.errors import CacheMiss, DeadlineExceeded, KVBudgetExhausted, StaleEpoch
from meshnet.kv.cache import SequenceKV
from meshnet.kv.manager import KVBudget
from meshnet.node.scheduler import Slot, StepWork, plan_batch


def _work(sid: str, rows: int, epoch: int = 1, deadline: float | None = None) -> StepWork:
    return StepWork(sid, epoch, np.zeros(rows, np.int64), deadline)


def _slots(*sids: str) -> dict[str, Slot]:
    return {s: Slot(1, SequenceKV(n_layers=1, n_kv_heads=1, head_dim=4)) for s in sids}


def _plan(pending, slots, budget=0, rows=16, chunk=4, now=0.0):  # type: ignore[no-untyped-def]
    return plan_batch(pending, slots, True, KVBudget(budget), rows, chunk, now)


def test_decodes_and_prompt_chunks_share_a_forward_in_queue_order() -> None:
    a, b, c = _work("a", 1), _work("b", 10), _work("c", 1)
    plan = _plan([a, b, c], _slots("a", "b", "c"))
    assert [(w.session_id, n) for w, n in plan.chosen] == [("a", 1), ("b", 4), ("c", 1)]
    b.done_rows = 8
    assert [n for w, n in _plan([b], _slots("b")).chosen] == [2]  # the prompt's last rows


def test_the_row_budget_stops_the_batch_but_always_runs_one_step() -> None:
    steps = [_work(s, 10) for s in "abcd"]
    plan = _plan(steps, _slots(*"abcd"), rows=8, chunk=4)
    assert [w.session_id for w, _ in plan.chosen] == ["a", "b"]
    plan = _plan(steps, _slots(*"abcd"), rows=2, chunk=4)
    assert [w.session_id for w, _ in plan.chosen] == ["a"]


def test_refusals_name_their_reason_and_the_rest_still_run() -> None:
    slots = _slots("late", "stale", "ok")
    slots["stale"].epoch = 3
    pending = [
        _work("late", 1, deadline=5.0),
        _work("stale", 1, epoch=2),
        _work("gone", 1),
        _work("ok", 1),
    ]
    plan = _plan(pending, slots, now=10.0)
    kinds = {w.session_id: type(e) for w, e in plan.refused}
    assert kinds == {"late": DeadlineExceeded, "stale": StaleEpoch, "gone": CacheMiss}
    assert [w.session_id for w, _ in plan.chosen] == ["ok"]


def test_the_kv_budget_counts_growth_of_the_whole_batch() -> None:
    # each new sequence reserves 64 positions * 2 (k, v) * 4 dims * 4 bytes = 2048 bytes
    plan = _plan([_work("a", 1), _work("b", 1)], _slots("a", "b"), budget=3000)
    assert [w.session_id for w, _ in plan.chosen] == ["a"]
    assert [(w.session_id, type(e)) for w, e in plan.refused] == [("b", KVBudgetExhausted)]
