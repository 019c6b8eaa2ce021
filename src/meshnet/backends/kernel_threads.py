"""How many threads the kernels run on: one count for the whole process.

numba keeps its count per thread. Set on the main thread (``meshnet node
--threads``), it left every other thread at numba's cap (``NUMBA_NUM_THREADS``,
all cores unless a local mesh narrows it): the engine loop, which runs every
forward, and a relay thread that runs a step. So the count is kept here, each
kernel call asks for it, and numba's own count follows it on the thread that
asks (its parallel kernels read that).
"""

from __future__ import annotations

import numba

# The process's count, as process-wide as numba's own setting; 0 until set_threads:
# numba's cap.
_count = 0


def set_threads(n: int) -> None:
    """Threads every thread of this process runs kernels on, within numba's cap."""
    global _count
    _count = max(1, min(n, _cap()))
    numba.set_num_threads(_count)


def kernel_threads() -> int:
    """The count for a kernel called on this thread (numba's kept in step with it)."""
    n = _count or _cap()
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


def _cap() -> int:
    """numba's cap on threads (its config sets the name at import: no type declares it)."""
    cap: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    return cap
