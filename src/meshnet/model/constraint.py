"""A grammar on the ids a generation samples: structured outputs by constrained decoding.

The grammar engine is llguidance (what llama.cpp uses): a grammar (llguidance's
JSON form, compiled from a JSON schema or Lark by ``grammar_from_*``) and the
model's vocabulary (model/grammar_vocab.py) give, after any sequence of ids, the
set of ids that keep the text inside the grammar. The sampler drops every other
id's logit before it picks (model/sampling.py), so the pick is still a function
of the logits, the parameters, the ids seen and the uniforms drawn.

The constraint's state is a function of the generated ids alone: the ids from
``start`` (the first sampled position) onwards are replayed into the matcher.
So a replacement last hop after a failover, or the verifier re-checking a pick,
arrives at the same mask from the same history. A matcher is kept and advanced
while each history extends the one before (a generation's steps), and rolled
back or rebuilt when it does not (a verifier going back over a chunk).

Grammars are bounded: their text's size, and the engine's own fuel and state
limits (``LIMITS``), so a hostile schema fails to compile rather than stall.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import llguidance
import numpy as np

from meshnet.errors import MalformedBundle, RequestError

MAX_GRAMMAR_CHARS = 256 * 1024  # a compiled grammar's text; a schema's is capped lower

# The engine's limits (see llguidance.LLParserLimits): compiling and each mask stay
# within a few tens of milliseconds; a grammar past them fails with an error.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis at compile time
    step_lexer_fuel=200_000,  # ~15 ms per mask at most
    max_lexer_states=100_000,
    max_grammar_size=100_000,
)


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer) -> str:
    """Why the engine refuses ``grammar`` for this vocabulary; "" when it compiles."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        return f"the grammar has {len(grammar)} characters, at most {MAX_GRAMMAR_CHARS}"
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    return matcher.get_error() if matcher.is_error() else ""


@dataclass(frozen=True)
class Constraint:
    """``grammar`` over the ids from history position ``start`` on, in ``tokenizer``'s
    vocabulary. Thread-safe: a verifier and a sampler may use one at once."""

    grammar: str  # llguidance's grammar text
    start: int  # history position of the first constrained (sampled) id
    tokenizer: llguidance.LLTokenizer = field(compare=False, repr=False)
    _replay: _Replay = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise RequestError("a constraint starts at a position >= 0")
        object.__setattr__(self, "_replay", _Replay(self.grammar, self.tokenizer))

    def at(self, start: int) -> Constraint:
        """This grammar over the ids from ``start`` on (a fresh matcher)."""
        return replace(self, start=start)

    def allowed(self, history: Sequence[int]) -> np.ndarray:
        """Which ids may come next [n_vocab] bool, after ``history`` (prompt + generated).

        Raises ``MalformedBundle`` when the generated ids already leave the grammar
        (they were not sampled under it)."""
        if len(history) < self.start:
            raise MalformedBundle(f"a history of {len(history)} ids ends before {self.start}")
        bits = self._replay.mask_after(history[self.start :])
        n = self.tokenizer.vocab_size
        return np.unpackbits(bits, count=n, bitorder="little").view(bool)

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """``logits`` [vocab] with every id the grammar refuses next set to -inf."""
        allowed = self.allowed(history)
        out = np.full_like(logits, -np.inf)
        n = min(len(allowed), len(logits))  # ids past the vocabulary view stay -inf
        np.copyto(out[:n], logits[:n], where=allowed[:n])
        return out

    def accepts(self, generated: Sequence[int]) -> bool:
        """Whether ``generated`` (ids from ``start``) is a complete text of the grammar."""
        return self._replay.accepting_after(generated)


def check_pick(constraint: Constraint, history: Sequence[int], token: int, node: str) -> None:
    """Raise ``MalformedBundle`` naming ``node`` when the grammar refuses ``token`` after
    ``history``: the tracker takes no id a last hop sampled outside it, so a replacement
    never inherits a history the grammar cannot continue."""
    allowed = constraint.allowed(history)
    if not (0 <= token < len(allowed) and allowed[token]):
        raise MalformedBundle(f"node {node} sampled id {token}, which the grammar refuses", node)


class _Replay:
    """One matcher, advanced over a history and moved back when a history differs."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
        self._grammar = grammar
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._matcher: llguidance.LLMatcher | None = None
        self._consumed: list[int] = []

    def mask_after(self, generated: Sequence[int]) -> np.ndarray:
        """The engine's bitmask after ``generated``: a bit per id, little-endian, as bytes
        (a fresh array: the caller may keep it)."""
        with self._lock:
            matcher = self._at(generated)
            words = np.empty((self._tokenizer.vocab_size + 31) // 32, np.int32)
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            return words.view(np.uint8)

    def accepting_after(self, generated: Sequence[int]) -> bool:
        with self._lock:
            try:
                return self._at(generated).is_accepting()
            except MalformedBundle:
                return False

    def _at(self, generated: Sequence[int]) -> llguidance.LLMatcher:
        """The matcher with exactly ``generated`` consumed (the lock held)."""
        ids = [int(i) for i in generated]
        matcher = self._matcher
        if matcher is None:
            matcher = llguidance.LLMatcher(
                self._tokenizer, self._grammar, log_level=0, limits=LIMITS
            )
            self._matcher = matcher
        common = _common_prefix(self._consumed, ids)
        back = len(self._consumed) - common
        if back and not matcher.rollback(back):
            matcher.reset()
            common = 0
        self._consumed = self._consumed[:common]
        rest = ids[common:]
        if rest and not matcher.consume_tokens(rest):
            error = matcher.get_error()
            self._matcher, self._consumed = None, []  # an error state is never left
            raise MalformedBundle(f"the generated ids leave the grammar: {error}")
        self._consumed.extend(rest)
        if matcher.is_error():
            self._matcher, self._consumed = None, []
            raise MalformedBundle(f"the grammar failed: {matcher.get_error()}")
        return matcher


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
