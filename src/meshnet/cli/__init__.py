"""The command-line entry points.

Importing this package (which every ``meshnet`` command does before numpy loads)
sets one process-wide default: OpenBLAS worker threads sleep as soon as a matmul
is done instead of spinning for ~10^8 cycles. Where the native kernels are not
built, prompt chunks go through BLAS and decode rows through numba's threads in
the same process; a spinning BLAS worker would take a core from the decode step
that follows (the output head after a prefill ran ~6x slower). A value already
in the environment wins.
"""

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
