"""The node's KV budget: bytes in use, peak, and whether more positions fit.

Bookkeeping only (vLLM keeps its block accounting apart from the tensors the
same way): the engine asks before it lets a step grow a cache, and running out
is a refusal the caller turns into ``kv-budget-exhausted``, never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVBudget:
    budget_bytes: int  # 0 means unlimited
    in_use: int = 0  # bytes held by every session's caches
    peak: int = 0

    def fits(self, extra: int) -> bool:
        """Whether ``extra`` more bytes stay within the budget."""
        return self.budget_bytes <= 0 or self.in_use + extra <= self.budget_bytes

    def update(self, in_use: int) -> None:
        self.in_use = in_use
        self.peak = max(self.peak, in_use)
