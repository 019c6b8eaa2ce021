"""Another build of the native extension, loaded beside this tree's: the kernel
benchmarks (``bench/q8_kernel.py``, ``bench/long_prefill.py``) take turns between the
build before a change and the one after it in one run. Where the change is to a
matrix layout, the old build multiplies matrices packed by the old tree's
``quant_layouts.py`` (``load_layouts``), never this tree's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_build(path: Path) -> ModuleType:
    """The extension module built at ``path`` (a ``.so`` copied aside before a rebuild)."""
    return _load("meshnet.backends._native", path, "not an extension module")


def load_layouts(path: Path) -> ModuleType:
    """The ``quant_layouts`` module at ``path`` (copied aside with the old build's ``.so``):
    its ``pack`` and ``q8_layout`` make the matrices that build reads."""
    return _load("meshnet_other_quant_layouts", path, "not a Python module")


def _load(name: str, path: Path, not_one: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: {not_one}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
