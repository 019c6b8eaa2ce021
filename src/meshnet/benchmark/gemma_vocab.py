"""A synthetic SentencePiece vocabulary of Gemma 3's size and layout, for GGUF files.

The Gemma 3 benchmark model needs a vocabulary as large as Gemma's (262,144 ids):
its embedding and tied head are most of the 270M model's bytes, and a tokenizer
that size is what meshnet and llama.cpp load beside it. Gemma's own vocabulary
cannot be fetched here, so this one is generated; it is not Gemma's. Its layout
is: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2 (control tokens) and ``<unk>`` 3 (the
unknown token), the 256 byte-fallback tokens ``<0x00>``..``<0xFF>`` (type BYTE),
then normal pieces: every character of ``ALPHABET``, then pieces each made of an
earlier piece and one more character, until the vocabulary is full. Each piece
can thus be reached by merging two shorter ones, as SentencePiece's merge loop
needs, and is scored by age (older pieces higher), so text merges into long
pieces. It is written as llama.cpp's converter writes a SentencePiece
vocabulary (``tokenizer.ggml.model`` "llama", pre-tokenizer "default", scores,
types, the special ids) with Gemma's flags: bos prepended, no eos appended, no
space prefix. Characters outside ``ALPHABET`` encode as their UTF-8 bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import gguf

from meshnet.errors import ModelError

GEMMA3_VOCAB_SIZE = 262_144
ESCAPED_SPACE = "\u2581"  # SentencePiece's space inside a piece
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3, as Gemma's
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(4)
FIRST_BYTE_ID = len(SPECIALS)
FIRST_PIECE_ID = FIRST_BYTE_ID + 256
ALPHABET = (
    ESCAPED_SPACE
    + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    + ".,;:!?'\"-()[]{}<>/\\@#$%&*+=_`~^|"
    + "\n\t"
)
# Characters a grown piece adds, weighted towards lower-case letters and the space
_GROWTH = ESCAPED_SPACE * 6 + "etaoinshrdlucmfwypvbgkjqxz" * 3 + ALPHABET
MIN_VOCAB_SIZE = FIRST_PIECE_ID + len(ALPHABET)
_SEED = 0  # one vocabulary per size: the model files' names need not carry it


@dataclass(frozen=True)
class SpmVocabulary:
    """What a GGUF's ``tokenizer.ggml.*`` keys say of a SentencePiece vocabulary."""

    tokens: list[str]  # one per id
    scores: list[float]
    types: list[int]  # gguf.TokenType per id

    def add_to(self, w: gguf.GGUFWriter) -> None:
        """Write the tokenizer keys in the converter's order (``_set_vocab_sentencepiece``,
        ``SpecialVocab``, then Gemma's ``add_space_prefix``)."""
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(self.tokens)
        w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_unk_token_id(UNK_ID)
        w.add_pad_token_id(PAD_ID)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)


def synthetic_vocabulary(size: int = GEMMA3_VOCAB_SIZE) -> SpmVocabulary:
    """The vocabulary of ``size`` ids (module docstring); the same every call."""
    if size < MIN_VOCAB_SIZE:
        raise ModelError(f"a vocabulary of {size} ids cannot hold the {MIN_VOCAB_SIZE} fixed ones")
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *ALPHABET]
    types = [control, control, control, int(gguf.TokenType.UNKNOWN)]
    types += [int(gguf.TokenType.BYTE)] * 256 + [normal] * len(ALPHABET)
    seen = set(tokens)
    pieces = list(ALPHABET)  # what a new piece may grow from
    rng = random.Random(_SEED)
    while len(tokens) < size:
        piece = rng.choice(pieces) + rng.choice(_GROWTH)
        if piece in seen:
            continue
        seen.add(piece)
        pieces.append(piece)
        tokens.append(piece)
        types.append(normal)
    # specials and bytes 0, as SentencePiece scores them; pieces by age, from -1 down
    scores = [0.0] * FIRST_PIECE_ID + [-float(i) for i in range(1, size - FIRST_PIECE_ID + 1)]
    return SpmVocabulary(tokens, scores, types)
