"""A whole model loaded in this process: file, spec, tokenizer, template, chain."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from meshnet.backends.shard import DEFAULT_BACKEND, load_shard
from meshnet.engine.chain import ShardChain
from meshnet.model.chat import ChatTemplate
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.info import load_model_info
from meshnet.model.layer_bytes import model_layer_bytes
from meshnet.model.spec import ModelSpec
from meshnet.model.tokenizer import TextTokenizer


@dataclass(frozen=True)
class LocalModel:
    """Everything needed to generate in-process."""

    file: GGUFFile
    spec: ModelSpec
    tokenizer: TextTokenizer
    template: ChatTemplate
    chain: ShardChain
    load_s: float  # wall time to parse, dequantize and build the chain


def load_local_model(
    path: str | os.PathLike[str] | None = None, split: int = 1, backend: str = DEFAULT_BACKEND
) -> LocalModel:
    """Load the model at ``path`` (the bundled one when None) as ``split`` chained shards,
    the layers split by their bytes (``LayerBytes.split``) as ``meshnet up`` splits them."""
    t0 = time.perf_counter()
    info = load_model_info(path)
    f, spec = info.file, info.spec
    ranges = model_layer_bytes(f, spec).split(split)
    shards = [load_shard(f, spec, r, backend) for r in ranges]
    chain = ShardChain(shards)
    return LocalModel(f, spec, info.tokenizer, info.template, chain, time.perf_counter() - t0)
