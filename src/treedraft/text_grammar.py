"""Constrained free text: the whole answer matches a regular expression, or is one of a list of strings
(vLLM's ``guided_regex`` / ``guided_choice``, ``structured_outputs`` ``regex`` / ``choice``).

:class:`TextGrammar` has the automaton interface the engine drives for JSON mode (:class:`treedraft.grammar.
JsonGrammar`: ``start``, ``advance``, ``allows``, ``allowed``, ``vocab_size``), so the same machinery applies: a
verify row is masked to the tokens the automaton allows after that row's path (:func:`treedraft.grammar.
constrain_`), drafts it refuses are pruned before they cost a row (:func:`treedraft.grammar.prune`), and
speculative output stays the constrained plain output.

The expression is an ECMA-262 regular expression (the subset of :mod:`treedraft.pattern`: no backreferences or
lookaround) matched against the whole answer, as Python's ``re.fullmatch`` does. A state is (DFA state, the bytes of
a character not yet complete): tokens may split a UTF-8 character. EOS is allowed where the text so far is a full
match, and it is the only token allowed once nothing can follow. Masks are computed per state by walking a byte trie
of the vocabulary with the DFA (only the branches that stay alive) and cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from .grammar import byte_trie, token_bytes_of
from .pattern import Pattern

MAX_MASKS = 512  # masks kept per grammar
DONE = (-2, b"")  # after EOS: only EOS again (a verify row past an accepted EOS still picks a bonus token)
_SPECIAL = "\\^$.|?*+()[]{}/"  # what escape() puts a backslash before


def escape(text: str) -> str:
    """``text`` as an expression that matches it literally."""
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def choice_pattern(choices: Sequence[str]) -> str:
    """The expression of "exactly one of ``choices``"."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "|".join(escape(c) for c in choices)


def full_match(regex: str) -> Pattern:
    """The DFA of the texts ``regex`` matches whole; a ValueError that names the expression (and the position in
    it) when it is not one :mod:`treedraft.pattern` supports."""
    if not isinstance(regex, str) or not regex:
        raise ValueError("regex must be a non-empty string")
    shown = regex if len(regex) <= 80 else regex[:77] + "..."
    try:
        return Pattern(regex, label=shown, full=True)
    except ValueError as e:
        msg = str(e).removeprefix(f"pattern {regex!r}: ")
        raise ValueError(f"regex {shown!r}: {msg}".replace(repr(regex), repr(shown))) from None


def _utf8_len(lead: int) -> int:
    """Bytes of the character a lead byte starts; 0 for a byte that cannot start one."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


_MIN_CP = (0, 0, 0x80, 0x800, 0x10000)  # the smallest code point of a 1..4-byte character (shorter is overlong)


def _prefix_range(pend: bytes, need: int) -> tuple[int, int]:
    """The code points a character's first bytes ``pend`` (of ``need``) can still become."""
    cp = pend[0] & (0x7F, 0x1F, 0x0F, 0x07)[need - 1]
    for c in pend[1:]:
        cp = (cp << 6) | (c & 0x3F)
    left = 6 * (need - len(pend))
    return max(cp << left, _MIN_CP[need]), min((cp << left) | ((1 << left) - 1), 0x10FFFF)


# the second byte's range after these lead bytes (UTF-8's rules: no overlong forms, no surrogates, nothing past
# U+10FFFF); after any other lead byte and for later bytes, 0x80-0xBF
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _feed(p: Pattern, d: int, pend: bytes, data: bytes) -> tuple[int, bytes] | None:
    """The state after ``data``; None once no match can follow (or the bytes are not UTF-8). A character's first
    bytes are taken only if some character they can still become may follow (else the answer would dead-end)."""
    for b in data:
        pend += bytes((b,))
        need = _utf8_len(pend[0])
        if need == 0 or (len(pend) > 1 and not 0x80 <= b <= 0xBF):
            return None
        if len(pend) == 2 and pend[0] in _SECOND and not _SECOND[pend[0]][0] <= b <= _SECOND[pend[0]][1]:
            return None
        if len(pend) < need:
            lo, hi = _prefix_range(pend, need)
            if lo > hi or not p.any_in(d, lo, hi):
                return None
            continue
        try:
            cp = ord(pend.decode("utf-8"))
        except UnicodeDecodeError:  # overlong or surrogate forms
            return None
        d = p.next(d, cp)
        if d < 0:
            return None
        pend = b""
    return d, pend


class TextVocab:
    """A vocabulary's token bytes, EOS ids and byte trie: built once per model, shared by every expression."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_ids: Iterable[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos = frozenset(int(t) for t in eos_ids if 0 <= int(t) < vocab_size)
        # a token's bytes; None for EOS (handled apart), special and empty tokens, which never spell text
        self.token_bytes = [b if b and t not in self.eos else None for t, b in enumerate(token_bytes[:vocab_size])]
        self.trie = byte_trie(self.token_bytes)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> TextVocab:
        return cls(token_bytes_of(tokenizer), tokenizer.eos_token_ids, vocab_size)

    def grammar(self, regex: str) -> TextGrammar:
        """The grammar of "the whole answer matches ``regex``" (ValueError naming it when it cannot be one, or when no
        token of this vocabulary can begin an answer matching it)."""
        g = TextGrammar(self, full_match(regex))
        if not g.allowed(g.start()).any():  # else the request fails mid-generation, naming a token id
            raise ValueError(
                f"no answer matching {regex[:80]!r} can be written with this model's vocabulary: no token begins one "
                "(characters it has no tokens for?)"
            )
        return g


class TextGrammar:
    """The answer is a full match of ``pattern`` (see the module docstring), over ``vocab``."""

    def __init__(self, vocab: TextVocab, pattern: Pattern) -> None:
        self.vocab_size = vocab.vocab_size
        self.pattern = pattern
        self.eos = vocab.eos
        self.token_bytes = vocab.token_bytes
        self._trie = vocab.trie
        self._masks: OrderedDict[tuple[int, bytes], np.ndarray] = OrderedDict()  # the last MAX_MASKS states

    def start(self) -> tuple[int, bytes]:
        return (0, b"")

    def done(self, s: tuple[int, bytes]) -> bool:
        """Whether the text so far is a full match (EOS may come)."""
        return s != DONE and not s[1] and self.pattern.accepts(s[0])

    def advance(self, s: tuple[int, bytes] | None, token: int) -> tuple[int, bytes] | None:
        if s is None:
            return None
        if token in self.eos:
            return DONE if s == DONE or self.done(s) else None
        if s == DONE:
            return None
        b = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        if not b:
            return None
        return _feed(self.pattern, s[0], s[1], b)

    def allows(self, s: tuple[int, bytes], token: int) -> bool:
        return self.advance(s, token) is not None

    def allowed(self, s: tuple[int, bytes]) -> np.ndarray:
        """(V,) bool: the tokens that keep a full match reachable after ``s`` (EOS where ``s`` is one)."""
        got = self._masks.get(s)
        if got is not None:
            self._masks.move_to_end(s)
            return got
        mask = np.zeros(self.vocab_size, dtype=bool)
        if s == DONE:
            mask[list(self.eos)] = True
        else:
            p = self.pattern
            todo = [(self._trie, s[0], s[1])]
            while todo:
                node, d, pend = todo.pop()
                for c, kid in node.kids.items():
                    nxt = _feed(p, d, pend, bytes((c,)))
                    if nxt is None:
                        continue
                    if kid.ids:
                        mask[kid.ids] = True
                    if kid.kids:
                        todo.append((kid, *nxt))
            if self.done(s):
                mask[list(self.eos)] = True
        self._masks[s] = mask
        while len(self._masks) > MAX_MASKS:  # 49 KB each for a 49k vocabulary; counted repetitions make many states
            self._masks.popitem(last=False)
        return mask
