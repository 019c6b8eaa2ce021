"""Model references: what a user may write where a model file is taken.

- ``hf:ORG/REPO`` — the repository's Q4_K_M file, or its only GGUF;
- ``hf:ORG/REPO:QUANT`` — the file of that quantization, as llama.cpp's
  ``-hf ORG/REPO:QUANT`` picks it (``quant.pick_files``; a split GGUF's
  ``-00001-of-0000N`` parts together);
- ``hf:ORG/REPO/FILE`` — that file (``FILE`` may lie in a folder);
- ``https://...`` (or ``http://``) — a plain URL;
- anything else — a path on this machine, taken as it is.

Parsing is pure: nothing here touches the network (``remote.locate`` does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshnet.errors import ModelSourceError

HF_PREFIX = "hf:"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,31}")
MAX_REF_CHARS = 2048


@dataclass(frozen=True)
class HubRef:
    """A model on a Hugging Face hub (``HF_ENDPOINT``): a repository and a file of it,
    named outright (``filename``) or by quantization (``quant``; neither: the default)."""

    repo: str  # ORG/REPO
    quant: str | None = None
    filename: str | None = None
    revision: str = "main"

    def __str__(self) -> str:
        if self.filename:
            return f"{HF_PREFIX}{self.repo}/{self.filename}"
        return f"{HF_PREFIX}{self.repo}" + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class UrlRef:
    """A GGUF file at a plain HTTP(S) URL."""

    url: str

    def __str__(self) -> str:
        return self.url

    @property
    def filename(self) -> str:
        return self.url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1] or "model.gguf"


ModelRef = HubRef | UrlRef


def is_reference(text: str | None) -> bool:
    """Whether ``text`` is a model reference rather than a local path."""
    return text is not None and text.startswith((HF_PREFIX, "https://", "http://"))


def parse_ref(text: str) -> ModelRef:
    """The reference ``text`` spells; ``ModelSourceError`` naming what is wrong."""
    if len(text) > MAX_REF_CHARS:
        raise ModelSourceError(f"a model reference is at most {MAX_REF_CHARS} characters")
    if text.startswith(("https://", "http://")):
        if any(c.isspace() for c in text) or len(text.split("/", 3)) < 4:
            raise ModelSourceError(f"{text!r} is not a URL of a file")
        return UrlRef(text)
    if not text.startswith(HF_PREFIX):
        raise ModelSourceError(f"{text!r} is not a model reference (hf:ORG/REPO[:QUANT], URL)")
    return _parse_hub(text[len(HF_PREFIX) :], text)


def _parse_hub(body: str, text: str) -> HubRef:
    path, _, quant = body.partition(":")
    parts = path.split("/")
    if len(parts) < 2 or not all(_NAME.fullmatch(p) for p in parts[:2]):
        raise ModelSourceError(f"{text!r}: expected hf:ORG/REPO[:QUANT] or hf:ORG/REPO/FILE")
    repo = "/".join(parts[:2])
    if len(parts) > 2:
        if quant:
            raise ModelSourceError(f"{text!r}: name a file or a quantization, not both")
        return HubRef(repo, filename=_checked_file(parts[2:], text))
    if quant and not _QUANT.fullmatch(quant):
        raise ModelSourceError(f"{text!r}: {quant!r} is not a quantization (e.g. Q4_K_M)")
    return HubRef(repo, quant=quant or None)


def _checked_file(parts: list[str], text: str) -> str:
    if any(not p or p in (".", "..") for p in parts) or not parts[-1].endswith(".gguf"):
        raise ModelSourceError(f"{text!r}: the file must be a .gguf path inside the repository")
    return "/".join(parts)
