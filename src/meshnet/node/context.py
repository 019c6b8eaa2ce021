"""The context a node serves: its model's trained context, or less where the operator
says so (``--ctx``), and checked at load against the node's KV budget.

A node configured for a context must be able to hold one sequence of it: a KV budget
too small for that is refused when the layers load (``KVBudgetExhausted``), not found
out in the middle of someone's long prompt. Without ``--ctx`` the node serves up to the
trained context and the budget is checked step by step as ever (a default budget need
not hold a 128k-token sequence). The context goes out with every heartbeat; the tracker
refuses a request past the least context of its nodes (``ContextTooLong``, a 400).
"""

from __future__ import annotations

from meshnet.backends.shard import Shard
from meshnet.errors import KVBudgetExhausted


def served_context(shard: Shard, ctx: int) -> int:
    """Positions a sequence may reach on ``shard``: ``ctx`` (0: no limit of its own),
    at most the model's trained context."""
    trained = shard.spec.context_length
    return min(ctx, trained) if ctx > 0 else trained


def check_context_budget(shard: Shard, ctx: int, budget_bytes: int) -> None:
    """``KVBudgetExhausted`` when a configured ``ctx`` does not fit a budget of
    ``budget_bytes`` (0: unlimited) for one sequence of it on ``shard``'s layers."""
    if ctx <= 0 or budget_bytes <= 0:
        return
    positions = served_context(shard, ctx)
    need = shard.backend.new_kv().growth_bytes(positions)  # windowed layers: their rings
    if need > budget_bytes:
        raise KVBudgetExhausted(
            f"--ctx {positions} needs {need} bytes of KV for one sequence on layers "
            f"{shard.layers}; the KV budget is {budget_bytes} bytes"
        )
