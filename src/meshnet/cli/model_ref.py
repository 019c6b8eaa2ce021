"""``--model`` as commands take it: a GGUF path, or a reference (``hf:ORG/REPO[:QUANT]``,
``hf:ORG/REPO/FILE``, an ``https://`` URL) fetched first, with a progress bar."""

from __future__ import annotations

import sys

from meshnet.model.info import ModelInfo
from meshnet.model_source.config import source_config
from meshnet.model_source.info import model_info
from meshnet.model_source.progress import ProgressBar
from meshnet.model_source.reference import is_reference, parse_ref
from meshnet.model_source.remote import locate
from meshnet.model_source.whole import local_model_path

MODEL_HELP = (
    "GGUF file, or hf:ORG/REPO[:QUANT], hf:ORG/REPO/FILE, an https:// URL "
    "(default: the bundled model)"
)


def whole_model(text: str | None, client: str = "cli") -> str | None:
    """``text`` as a local file a whole-model command loads (None stays None: bundled)."""
    if text is None or not is_reference(text):
        return text
    cfg = source_config(client)
    bar = _bar(text, client) if sys.stderr.isatty() else None
    try:
        return str(local_model_path(text, cfg, bar))
    finally:
        if bar is not None:
            bar.close()


def header_info(text: str | None, client: str = "cli") -> ModelInfo:
    """What ``meshnet up`` plans by: the info of a path, or of a reference as the tracker
    reads it (its header kept; the manifest made once and kept for the tracker too)."""
    if text is None or not is_reference(text):
        return model_info(text, source_config(client))
    bar = _bar(text, client) if sys.stderr.isatty() else None
    try:
        return model_info(text, source_config(client), bar)
    finally:
        if bar is not None:
            bar.close()


def _bar(text: str, client: str) -> ProgressBar:
    size = locate(parse_ref(text), source_config(client)).size
    return ProgressBar(text, size)
