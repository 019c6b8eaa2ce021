"""The grammar engine's view of the vocabulary a sampling hop picks from.

A last hop that is asked to sample under a grammar (``Sampling.grammar``) needs
what every id of its model spells (model/grammar_vocab.py). Nodes load only
their layers' tensors, not the tokenizer, so the view is built from the shard's
GGUF at the first constrained open and kept while the node serves that file. The
grammar engine (llguidance) is imported then too: a node never asked for one does
without it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from meshnet.backends.shard import Shard
from meshnet.errors import MalformedBundle, ShardMismatch
from meshnet.model.gguf_file import open_gguf
from meshnet.protocol import meshnet_pb2 as pb

if TYPE_CHECKING:  # the grammar engine loads with the first constrained open, not before
    import llguidance

    from meshnet.model.constraint import Constraint


class GrammarTokenizers:
    """The view of the loaded shard's vocabulary, built once per file. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, str] | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None

    def of(self, shard: Shard) -> llguidance.LLTokenizer:
        """The view for ``shard``'s model (built now if the node serves a new file)."""
        if not shard.source:
            raise ShardMismatch("this node's shard was not read from a file: no vocabulary")
        key = (shard.fingerprint, shard.source)
        with self._lock:
            if self._key != key or self._tokenizer is None:
                from meshnet.model.grammar_vocab import grammar_tokenizer
                from meshnet.model.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(open_gguf(shard.source))
                self._tokenizer = grammar_tokenizer(tokenizer, shard.spec.vocab_size)
                self._key = key
            return self._tokenizer

    def constraint(self, sampling: pb.Sampling, shard: Shard) -> Constraint | None:
        """The Open's grammar bound to the vocabulary; None when it has none.

        Raises ``MalformedBundle`` when the engine refuses the grammar."""
        if not sampling.grammar:
            return None
        from meshnet.model.constraint import Constraint, check_grammar

        tokenizer = self.of(shard)
        why = check_grammar(sampling.grammar, tokenizer)
        if why:
            raise MalformedBundle(f"the sampling grammar does not compile: {why}")
        if sampling.grammar_start > shard.spec.context_length:
            raise MalformedBundle("the grammar starts past the context")
        return Constraint(sampling.grammar, sampling.grammar_start, tokenizer)
