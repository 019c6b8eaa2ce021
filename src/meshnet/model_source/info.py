"""A model's ``ModelInfo`` from a path or a reference: what the tracker and ``meshnet up`` read.

A reference is read as the tracker reads it (``tracker_source``): its header and
small shared tensors in a sparse copy, its sha256 as fingerprint, its manifest
carried in the info so nodes can be given it.
"""

from __future__ import annotations

from dataclasses import replace

from meshnet.model.info import ModelInfo, load_model_info
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.progress import OnBytes
from meshnet.model_source.reference import is_reference
from meshnet.model_source.tracker_source import tracker_model


def model_info(text: str | None, cfg: SourceConfig, progress: OnBytes | None = None) -> ModelInfo:
    """``load_model_info`` of a path (None: the bundled model) or of a reference."""
    if text is None or not is_reference(text):
        return load_model_info(text)
    tm = tracker_model(text, cfg, progress)
    info = load_model_info(tm.path, fingerprint=tm.manifest.fingerprint, name=tm.name)
    return replace(info, ref=text, manifest_json=tm.manifest.to_json())
