"""The kernels' thread count is the process's, whichever thread runs them.

numba keeps its count per thread: set on the main thread (``meshnet node --threads``),
it left the engine loop's thread, which runs every forward, at numba's cap.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import threading
import numba
import numpy as np
from meshnet.backends import quant
from meshnet.backends.kernel_threads import set_threads

seen = []

class Recorder:  # stands in for the extension: records the threads a matmul is given
    def matmul(self, packed, x, out, rows, nb, t, code, threads, wide):
        seen.append(threads)

quant.NATIVE = Recorder()
w = quant.QuantMatrix(quant.QT.F32, 4, 32, np.zeros((4, 32), np.float32), native=True)
set_threads(1)

def step():
    quant.matmul(np.zeros((1, 32), np.float32), w)
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
    assert out.strip() == "[1, 1]"
