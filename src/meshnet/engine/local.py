"""A whole model loaded in this process: file, spec, tokenizer, template, chain."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from meshnet.engine.chain import ShardChain
from meshnet.layer_range import split_evenly
from meshnet.model.bundled import bundled_model_path
from meshnet.model.chat import ChatTemplate, load_chat_template
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.shard import DEFAULT_BACKEND, load_shard
from meshnet.model.spec import ModelSpec, read_spec
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer


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
    """Load the model at ``path`` (the bundled one when None) as ``split`` chained shards."""
    t0 = time.perf_counter()
    f = open_gguf(Path(path) if path is not None else bundled_model_path())
    spec = read_spec(f)
    tokenizer = load_tokenizer(f)
    template = load_chat_template(f, [str(t) for t in f.value("tokenizer.ggml.tokens")])
    shards = [load_shard(f, spec, r, backend) for r in split_evenly(spec.n_layers, split)]
    return LocalModel(f, spec, tokenizer, template, ShardChain(shards), time.perf_counter() - t0)
