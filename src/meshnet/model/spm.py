"""SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) as llama.cpp runs them.

llama.cpp's SPM tokenizer starts from the characters of the text (spaces
escaped as U+2581, one prepended when ``add_space_prefix``), repeatedly
merges the adjacent pair whose concatenation is a token of the highest score
(the leftmost on a tie), and spells a piece that is no token as its UTF-8
bytes ``<0xXX>``. A BPE model whose merge list holds every pair
``(left, right)`` whose halves and concatenation are tokens, ranked by the
concatenation's score, makes the same choices; the ``tokenizers`` library's
BPE with ``byte_fallback`` then runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers

ESCAPED_SPACE = "\u2581"  # how SentencePiece writes a space inside a token


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose halves and concatenation are tokens, best score first.

    Ties keep the token-list order, which for converted vocabularies is the
    order SentencePiece ranked them in.
    """
    vocab = set(tokens)
    order = sorted(range(len(tokens)), key=lambda i: -scores[i])
    merges: list[tuple[str, str]] = []
    for i in order:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    unk_token: str | None,
    add_space_prefix: bool,
) -> Tokenizer:
    """A ``tokenizers`` Tokenizer that segments as llama.cpp's SPM tokenizer does."""
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores),
        unk_token=unk_token,
        fuse_unk=False,
        byte_fallback=True,
    )
    hf = Tokenizer(model)
    steps: list[normalizers.Normalizer] = []
    if add_space_prefix:
        steps.append(normalizers.Prepend(ESCAPED_SPACE))
    steps.append(normalizers.Replace(" ", ESCAPED_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    # The leading space add_space_prefix put there is removed by TextTokenizer.decode,
    # which knows whether the text starts the sequence.
    hf.decoder = decoders.Sequence(
        [decoders.Replace(ESCAPED_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return hf
