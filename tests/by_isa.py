"""Run a script once per instruction set the kernels may take, for tests that a result's
bits do not depend on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def outputs_by_isa(script: str, tmp_path: Path) -> list[np.ndarray]:
    """The arrays ``script`` saves to the path it is given (``sys.argv[1]``), run in a
    process of its own with the kernels held to AVX2, then with the widest the CPU has."""
    outs = []
    for isa in ("avx2", "auto"):
        env = {**os.environ, "MESHNET_ISA": isa}
        path = tmp_path / f"{isa}.npy"
        done = subprocess.run(
            [sys.executable, "-c", script, str(path)], env=env, capture_output=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        outs.append(np.load(path))
    return outs
