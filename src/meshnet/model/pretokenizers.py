"""llama.cpp's byte-level BPE pre-tokenizers, as data: name -> regexes and flags.

A GGUF of ``tokenizer.ggml.model == "gpt2"`` names its pre-tokenizer in
``tokenizer.ggml.pre``. llama.cpp splits the text with that pre-tokenizer's
regexes in order: each regex splits every piece the previous ones left,
keeping both the matches and the text between them. The ``tokenizers``
library does the same with a ``Split(..., "isolated")`` per regex followed by
the GPT-2 byte-to-unicode mapping, so one table serves both.

The patterns are the ones the models publish in their ``tokenizer.json``;
where llama.cpp spells a case-insensitive group ``(?i:'s|...)`` as explicit
classes (``'[sS]``), so do we, so that llama.cpp stays the reference.
An unknown name is refused with a ``TokenizerError`` naming it.
"""

# ruff: noqa: RUF001  (the patterns name non-ASCII letters and punctuation on purpose)

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from meshnet.errors import TokenizerError

# English contractions, case-insensitive as llama.cpp writes them.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


def _char_class(spans: tuple[tuple[int, int], ...]) -> str:
    """A regex class of code-point ranges, escaped (no look-alike characters in the source)."""
    return "[" + "".join(rf"\x{{{lo:X}}}-\x{{{hi:X}}}" for lo, hi in spans) + "]"


# CJK ideographs, a wide block below them, and Hangul, as deepseek's tokenizer.json has it.
_CJK = _char_class(((0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF))) + "+"
# The letters deepseek-llm's tokenizer.json lists (cased letters of the scripts it covers).
_DEEPSEEK_LETTER_SPANS = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)  # fmt: skip
_DEEPSEEK_LETTERS = r"\s?" + _char_class(_DEEPSEEK_LETTER_SPANS) + "+"
# ASCII and full-width punctuation, curly quotes, ideographic space and full stop.
_DEEPSEEK_PUNCTUATION = (
    r"\s?"
    + _char_class(
        (
            (0x21, 0x2F),
            (0x3A, 0x7E),
            (0xFF01, 0xFF0F),
            (0xFF1A, 0xFF5E),
            (0x2018, 0x201F),
            (0x3000, 0x3002),
        )
    )
    + "+"
)
# CJK ideographs, hiragana and katakana.
_KANJI_KANA = _char_class(((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF))) + "+"
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILING = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer: its regexes (applied in order) and its flags."""

    regexes: tuple[str, ...]
    # A word that is itself a token is emitted whole, before any merge (llama.cpp's
    # ignore_merges, the tokenizers library's BPE(ignore_merges=True)).
    ignore_merges: bool = False
    # llama.cpp's add_bos default for this pre-tokenizer, when the file does not say.
    add_bos: bool = False

    def build(self) -> pre_tokenizers.PreTokenizer:
        """The ``tokenizers`` pre-tokenizer: the splits, then the byte-level mapping."""
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.regexes]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([*splits, byte_level])


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_KIND = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_KIND = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_KIND = PreTokenizer((_QWEN2,))
_VIKING = PreTokenizer((_BLOOM, r"\p{N}"))

# Every name llama.cpp's llama-vocab.cpp accepts for a byte-level BPE vocabulary whose
# splitting the regexes above express, grouped as it groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        _LLAMA3_KIND,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], PreTokenizer((_LLAMA3,))),
    "chatglm-bpe": PreTokenizer((_LLAMA3,)),
    "glm4": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "glm5": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "deepseek-llm": PreTokenizer(
        ("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCTUATION, r"\s+$", _CJK, r"\p{N}+")
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    **dict.fromkeys(
        ["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        PreTokenizer((r"\p{N}{1,3}", _KANJI_KANA, _DEEPSEEK3_WORDS)),
    ),
    "falcon": PreTokenizer(
        (
            r"[\p{P}\$\+<=>\^~\|`]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            "[0-9][0-9][0-9]",
        )
    ),
    **dict.fromkeys(
        [
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        _DIGITS_THEN_GPT2,
    ),
    **dict.fromkeys(
        [
            "gpt2",
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        _GPT2_KIND,
    ),
    **dict.fromkeys(
        [
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
        ],
        _QWEN2_KIND,
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    "grok-2": _QWEN2_KIND,
    "ufakzeka": PreTokenizer((_QWEN2[len(_CONTRACTIONS) + 1 :],)),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], PreTokenizer((_BLOOM,))),
    "viking": _VIKING,
    "jais-2": PreTokenizer(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
            + r"|\s{1,2}(?!\S)|\s{1}",
        )
    ),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(
        ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], PreTokenizer((_GPT4O,))
    ),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], PreTokenizer((_BAILING,))),
    "seed-coder": PreTokenizer((_SEED_CODER,)),
    "minicpm5": PreTokenizer(
        (r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")), ignore_merges=True
    ),
}


def pre_tokenizer(name: str, file_name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp calls ``name``; ``TokenizerError`` naming it if unknown."""
    found = PRE_TOKENIZERS.get(name)
    if found is None:
        raise TokenizerError(f"{file_name}: pre-tokenizer {name!r} is not supported")
    return found
