"""The kernels' thread count is the process's, whichever thread runs them.

numba keeps its count per thread: set on the main thread (``meshnet node --threads``),
it left the engine loop's thread, which runs every forward, at numba's cap. numba is
loaded by the first numba kernel a process runs, after the count was set; its count
must follow the process's then too.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import sys
import threading
import numpy as np
from gguf import GGMLQuantizationType as QT
from meshnet.backends import quant
from meshnet.backends.kernel_threads import set_threads

seen = []

class Recorder:  # stands in for the extension: records the threads a matmul is given
    def matmul(self, packed, x, out, rows, nb, t, code, threads, wide):
        seen.append(threads)

quant.NATIVE = Recorder()
native = quant.QuantMatrix(QT.F32, 4, 32, np.zeros((4, 32), np.float32), native=True)
blocks = quant.from_blocks(np.zeros((4, 32), np.float32), QT.F32, (4, 32), native=False)
seen.append(set_threads(1))

def step():
    quant.matmul(np.zeros((1, 32), np.float32), native)
    seen.append("numba" in sys.modules)  # no numba kernel has run yet
    quant.matmul(np.zeros((1, 32), np.float32), blocks)  # loads numba, on this thread
    import numba
    seen.append(numba.get_num_threads())  # numba's own kernels, on this thread

worker = threading.Thread(target=step)
worker.start()
worker.join()
print(seen)
"""


def test_a_thread_that_did_not_set_the_kernel_threads_runs_with_them() -> None:
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}  # a cap above what is set
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[1, 1, False, 1]"


_CAP_PROBE = """
from meshnet.backends.kernel_threads import kernel_threads, numba_threads, set_threads
print([kernel_threads(), set_threads(8), numba_threads()])
"""


def test_the_cap_is_numba_threads_before_numba_loads() -> None:
    """``NUMBA_NUM_THREADS`` caps the count before numba is loaded as after."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "3"}
    out = subprocess.run(
        [sys.executable, "-c", _CAP_PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[3, 3, 3]"
