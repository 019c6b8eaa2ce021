"""How many threads the kernels run on: one count for the whole process.

numba keeps its count per thread. Set on the main thread (``meshnet node
--threads``), it left every other thread at numba's cap (``NUMBA_NUM_THREADS``,
all cores unless a local mesh narrows it): the engine loop, which runs every
forward, and a relay thread that runs a step. So the count is kept here, each
kernel call asks for it, and numba's own count follows it on the thread that
asks (its parallel kernels read that).

numba is loaded only by a process that runs one of its kernels (where the native
extension is built, a node never does: numba and its LLVM kept ~60 MB resident in
every node). A numba kernel's caller asks ``numba_threads``, which loads it the
first time; from then on numba's count follows the process's on every thread that
asks. Until then the count is kept here alone, under the cap numba would read:
``NUMBA_NUM_THREADS``, else the cores this process may run on.
"""

from __future__ import annotations

import os
from types import ModuleType

# The process's count, as process-wide as numba's own setting; 0 until set_threads:
# the cap.
_count = 0
# numba once a numba kernel has asked for it (numba_threads); None until then.
_numba: ModuleType | None = None


def set_threads(n: int) -> int:
    """Threads every thread of this process runs kernels on, within the cap; returns
    the count it set (less than ``n`` where the cap is lower)."""
    global _count
    _count = max(1, min(n, _cap()))
    if _numba is not None:
        _numba.set_num_threads(_count)
    return _count


def kernel_threads() -> int:
    """The count for a kernel called on this thread (numba's, once loaded, kept in step)."""
    n = _count or _cap()
    if _numba is not None and _numba.get_num_threads() != n:
        _numba.set_num_threads(n)
    return n


def numba_threads() -> int:
    """``kernel_threads`` for a numba kernel about to run on this thread: numba is
    imported the first time (the kernels' own modules import it too; this keeps its
    count on every thread that runs them the process's)."""
    global _numba
    if _numba is None:
        import numba  # ~60 MB resident: only a process that runs numba kernels pays it

        _numba = numba
    return kernel_threads()


def _cap() -> int:
    """The cap on threads: numba's where it is loaded (its config sets the name at import),
    else what it would read: ``NUMBA_NUM_THREADS``, else the cores this process may use."""
    if _numba is not None:
        cap: int = _numba.config.NUMBA_NUM_THREADS
        return cap
    try:
        return max(1, int(os.environ["NUMBA_NUM_THREADS"]))
    except (KeyError, ValueError):  # unset, or not a number (numba warns and ignores it)
        pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
