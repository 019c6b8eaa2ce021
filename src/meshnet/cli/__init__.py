"""The command-line entry points.

Importing this package (which every ``meshnet`` command does before numpy loads)
sets one process-wide default: OpenBLAS worker threads sleep as soon as a matmul
is done instead of spinning for ~10^8 cycles. Where the native kernels are not
built, prompt chunks go through BLAS and decode rows through numba's threads in
the same process; a spinning BLAS worker would take a core from the decode step
that follows (the output head after a prefill ran ~6x slower). A value already
in the environment wins.

And one import is ruled out: httpx's own command line (``httpx._main``), which httpx
imports with itself whenever click is installed, and with it rich and pygments: ~4 MB
resident in every node and tracker, for a ``main`` meshnet never calls. httpx falls
back to a stub ``main`` when that import fails.
"""

import os
import sys

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]  # None: not importable
