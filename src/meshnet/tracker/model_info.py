"""What the tracker knows of the model it serves: identity, shape, tokenizer, template.

The tracker reads the GGUF's metadata only; weights stay on the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshnet.model.bundled import bundled_model_path
from meshnet.model.chat import ChatTemplate, load_chat_template
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import ModelSpec, read_spec
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients put in "model"
    path: Path
    fingerprint: str  # sha256 of the GGUF; nodes must serve the same file
    spec: ModelSpec
    tokenizer: TextTokenizer
    template: ChatTemplate


def load_model_info(path: str | None) -> ModelInfo:
    p = Path(path) if path else bundled_model_path()
    f = open_gguf(p)
    spec = read_spec(f)
    return ModelInfo(
        name=p.name.removesuffix(".gguf"),
        path=p,
        fingerprint=f.fingerprint(),
        spec=spec,
        tokenizer=load_tokenizer(f),
        template=load_chat_template(f, [str(t) for t in f.value("tokenizer.ggml.tokens")]),
    )
