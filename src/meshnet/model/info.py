"""What is known of a model without its weights: identity, shape, tokenizer, template.

The tracker needs only this; an in-process model adds shards on top of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import llguidance

from meshnet.model.bundled import bundled_model_path
from meshnet.model.chat import ChatTemplate, load_chat_template
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.gguf_split import model_stem
from meshnet.model.grammar_vocab import grammar_tokenizer
from meshnet.model.spec import ModelSpec, read_spec
from meshnet.model.tokenizer import TOKENIZER_ARRAYS, TextTokenizer, load_tokenizer


@dataclass(frozen=True)
class ModelInfo:
    file: GGUFFile  # parsed metadata less the tokenizer's arrays; tensor data stays mapped, unread
    name: str  # the id clients put in "model"
    path: Path
    fingerprint: str  # sha256 of the GGUF; nodes must serve the same file
    spec: ModelSpec
    tokenizer: TextTokenizer
    template: ChatTemplate
    # A model by reference (``model_source``): what it was named by, and its manifest of
    # per-tensor hashes (JSON) that nodes fetch against; None for a local file.
    ref: str | None = None
    manifest_json: str | None = None

    @cached_property
    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """The grammar engine's view of the vocabulary (built at first use, ~1 s for a
        large one; two threads at once may both build it, to the same effect)."""
        return grammar_tokenizer(self.tokenizer, self.spec.vocab_size)


def load_model_info(
    path: str | os.PathLike[str] | None = None,
    *,
    fingerprint: str | None = None,
    name: str | None = None,
) -> ModelInfo:
    """Read the metadata of the GGUF at ``path`` (the bundled model when None).
    ``fingerprint``: the model's sha256 when ``path`` is not the whole file (a
    tracker's sparse copy of a referenced model), else it is computed; ``name``:
    the served name (default: the file name less ``.gguf`` and a split suffix)."""
    p = Path(path) if path is not None else bundled_model_path()
    f = open_gguf(p)
    if fingerprint is not None:
        f.known_fingerprint(fingerprint)
    spec = read_spec(f)
    tokenizer = load_tokenizer(f)
    template = load_chat_template(f, tokenizer)
    f.drop(TOKENIZER_ARRAYS)  # the tokenizer holds what it needs of them
    return ModelInfo(
        file=f,
        name=name or model_stem(p.name),
        path=p,
        fingerprint=f.fingerprint(),
        spec=spec,
        tokenizer=tokenizer,
        template=template,
    )
