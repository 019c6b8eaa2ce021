"""Another build of the native extension, loaded beside this tree's: the kernel
benchmarks (``bench/q8_kernel.py``, ``bench/long_prefill.py``) take turns between the
build before a change and the one after it in one run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_build(path: Path) -> ModuleType:
    """The extension module built at ``path`` (a ``.so`` copied aside before a rebuild)."""
    spec = importlib.util.spec_from_file_location("meshnet.backends._native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
