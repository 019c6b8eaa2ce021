"""Which tokens of a GGUF vocabulary are special, and which end generation, as llama.cpp says.

llama.cpp reads the ids of bos/eos/eot/eom/... from ``tokenizer.ggml.*_token_id``
with defaults per tokenizer model, treats control, user-defined and
unknown-type tokens as special (matched whole in the text), and stops
generating at every id in its end-of-generation set: eos, eot, eom, the
fill-in-the-middle pad/repo/separator ids, and tokens whose text is one of the
known turn-closing markers (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``...),
which it also makes control tokens.
"""

# ruff: noqa: RUF001  (DeepSeek's marker is written with full-width bars on purpose)

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnet.model.gguf_file import GGUFFile

# llama.cpp's LLAMA_TOKEN_TYPE_* values that make a token special.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPECIAL_TYPES = frozenset({_UNKNOWN, _CONTROL, _USER_DEFINED})

# Token texts llama.cpp treats as ending generation whatever their type.
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)

# Ids that end generation when the file names them.
_EOG_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)

# llama.cpp's default bos/eos per tokenizer model, used when the key is absent.
_DEFAULT_BOS_EOS = {True: (1, 2), False: (11, 11)}  # keyed by "is SentencePiece"


@dataclass(frozen=True)
class SpecialTokens:
    """The special ids of one vocabulary."""

    bos_id: int | None
    eos_id: int | None
    special_ids: frozenset[int]  # matched whole in text, spelled out on decode
    eog_ids: frozenset[int]  # generation stops after any of these


def read_special_tokens(
    f: GGUFFile, tokens: Sequence[str], types: Sequence[int], spm: bool
) -> SpecialTokens:
    """The special tokens of ``f``'s vocabulary (``types`` may be empty: none typed)."""
    n = len(tokens)
    default_bos, default_eos = _DEFAULT_BOS_EOS[spm]
    bos = _id(f, "tokenizer.ggml.bos_token_id", default_bos, n)
    eos = _id(f, "tokenizer.ggml.eos_token_id", default_eos, n)
    by_text = {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    eog = by_text | {i for key in _EOG_KEYS if (i := _id(f, key, None, n)) is not None}
    if eos is not None:
        eog.add(eos)
    special = {i for i, t in enumerate(types) if t in _SPECIAL_TYPES} | by_text
    _apply_exceptions(tokens, eog, special)
    return SpecialTokens(
        bos_id=bos, eos_id=eos, special_ids=frozenset(special), eog_ids=frozenset(eog)
    )


def _apply_exceptions(tokens: Sequence[str], eog: set[int], special: set[int]) -> None:
    """llama.cpp's two exceptions to the marker list, by the other markers present.

    In the harmony format (``<|return|>`` and ``<|call|>``, or solar-open's
    ``<|calls|>`` and ``<|flush|>``) ``<|end|>`` closes a message, not the
    generation; where ``<|tool_response>`` or ``<|plamo:eos|>`` ends turns,
    ``</s>`` is ordinary text.
    """
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (
        {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
    ):
        eog.discard(texts["<|end|>"])
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        special.discard(texts["</s>"])


def _id(f: GGUFFile, key: str, default: int | None, n_tokens: int) -> int | None:
    """The id under ``key``: llama.cpp ignores one outside the vocabulary, as a default."""
    value = f.value_or(key, None)
    if isinstance(value, int) and 0 <= value < n_tokens:
        return value
    return default if default is not None and default < n_tokens else None
