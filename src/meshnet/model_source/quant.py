"""Which files of a repository a quantization names, as llama.cpp's ``-hf`` picks them.

A quantization matches a GGUF whose name (less ``.gguf`` and a split suffix) holds
it as a whole word: ``Q4_K`` matches ``model-Q4_K.gguf`` and ``model.q4_k.gguf``
but neither ``model-Q4_K_M.gguf`` nor ``model-IQ4_K.gguf``. Case is ignored.
Without a quantization the default is Q4_K_M, else the repository's only model.
Projector files (``mmproj*``) are never models. A split GGUF
(``NAME-00001-of-00003.gguf``) is its parts together, in order, and only whole.

Pure: the names come from the hub listing (``remote.locate``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from meshnet.errors import ModelRefNotFound

DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


def model_files(names: Iterable[str]) -> list[str]:
    """The GGUF model files among ``names`` (projectors left out), sorted."""
    return sorted(
        n for n in names if n.endswith(".gguf") and not n.rsplit("/", 1)[-1].startswith("mmproj")
    )


def stem(name: str) -> str:
    """A model file's name less folder, ``.gguf`` and split suffix."""
    base = name.rsplit("/", 1)[-1]
    split = _SPLIT.match(base)
    return split.group("stem") if split else base.removesuffix(".gguf")


def _has_quant(name: str, quant: str) -> bool:
    pattern = rf"(?:^|[-._ ]){re.escape(quant)}(?:$|[-. ])"
    return re.search(pattern, stem(name), re.IGNORECASE) is not None


def pick_files(names: Iterable[str], quant: str | None, repo: str) -> tuple[str, ...]:
    """The file, or a split GGUF's parts in order, that ``quant`` names among ``names``;
    ``ModelRefNotFound`` naming the model files there are when none or several match."""
    files = model_files(names)
    if quant is None:
        chosen = [f for f in files if _has_quant(f, DEFAULT_QUANT)]
        if not chosen and len({_group(f) for f in files}) == 1:
            chosen = files
    else:
        chosen = [f for f in files if _has_quant(f, quant)]
    groups = sorted({_group(f) for f in chosen})
    what = f"quantization {quant}" if quant else f"a {DEFAULT_QUANT} or single model file"
    if len(groups) != 1:
        found = "several match: " if groups else "none matches; "
        raise ModelRefNotFound(f"hf:{repo} has no one {what} ({found}{_listing(files)})")
    return _whole(sorted(f for f in chosen if _group(f) == groups[0]), repo)


def _group(name: str) -> str:
    """The file, or a split GGUF's folder and stem: what one model is."""
    split = _SPLIT.match(name)
    return split.group("stem") if split else name


def _whole(parts: list[str], repo: str) -> tuple[str, ...]:
    split = _SPLIT.match(parts[0])
    if split is None:
        return tuple(parts)
    count = int(split.group("count"))
    want = [f"{split.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [w for w in want if w not in parts]
    if missing:
        raise ModelRefNotFound(f"hf:{repo}: split GGUF parts missing: {', '.join(missing)}")
    return tuple(want)


def _listing(files: list[str]) -> str:
    if not files:
        return "the repository has no .gguf file"
    return "files there: " + ", ".join(files)
