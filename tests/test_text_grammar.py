"""Constrained free text (regex / choice): the automaton against Python's re.fullmatch on a vocabulary with split
UTF-8 characters, masks against token-by-token checks, no dead ends, and speculative = plain under it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treedraft.text_grammar import DONE, TextVocab, choice_pattern, escape, full_match

EOS = 0
# token 0 is EOS; every printable ASCII byte alone (as a byte-level vocabulary has), some multi-character pieces,
# and "é" (2 bytes) and "€" (3 bytes) both whole and split, so tokens end mid-character
PIECES = (
    [None]
    + [bytes((c,)) for c in range(0x20, 0x7F)]
    + [b"ab", b"abc", b"ba", b"yes", b"no", b"xy ", b", ", b"10", b"99"]
    + ["é".encode(), "€".encode(), "é".encode()[:1], "é".encode()[1:], "€".encode()[:2], "€".encode()[2:]]
    + [b"a\xc3", b"\xa9b"]  # "a" + the first byte of "é"; its second byte + "b"
    + [b"\xed", b"\xa0", b"\x9f"]  # a lead byte whose second byte decides: 0xA0 would begin a surrogate, 0x9F not
)
VOCAB = TextVocab(PIECES, [EOS], len(PIECES))
REGEXES = ["a+b?", "(yes|no)[.!]?", "[0-9]{2,3}-[0-9]", "é*€?", "x(é|€)y", "(ab|ba)*c", "[^a-c]{1,2}"]


def texts_of(g, s, depth: int) -> set[bytes]:
    """Every token sequence (up to ``depth`` tokens) the automaton lets through and ends with EOS, as bytes."""
    out = set()
    if g.allows(s, EOS):
        out.add(b"")
    if depth:
        for t in np.flatnonzero(g.allowed(s)):
            if t != EOS:
                out |= {PIECES[t] + rest for rest in texts_of(g, g.advance(s, int(t)), depth - 1)}
    return out


@pytest.mark.parametrize("regex", REGEXES)
def test_accepted_texts_are_exactly_the_full_matches(regex: str) -> None:
    """Every text the automaton completes (EOS allowed) is a full match; every full match spelled by up to 2 tokens
    is completed; masks equal token-by-token checks; no reachable state leaves nothing to take."""
    g = VOCAB.grammar(regex)
    got = texts_of(g, g.start(), 3)
    assert got and all(re.fullmatch(regex, t.decode("utf-8")) for t in got), got
    # brute force: all sequences of up to 2 non-EOS tokens
    seqs = [(), *((t,) for t in range(1, len(PIECES)))]
    seqs += [(a, b) for a in range(1, len(PIECES)) for b in range(1, len(PIECES))]
    for seq in seqs:
        data = b"".join(PIECES[t] for t in seq)
        try:
            ok = re.fullmatch(regex, data.decode("utf-8")) is not None
        except UnicodeDecodeError:
            ok = False
        if ok:
            assert data in got, (regex, data)
    # the masks are the per-token checks, and every state reached has something to take
    todo, seen = [g.start()], set()
    while todo and len(seen) < 200:
        s = todo.pop()
        if s in seen or s == DONE:
            continue
        seen.add(s)
        mask = g.allowed(s)
        assert mask.tolist() == [g.advance(s, t) is not None for t in range(len(PIECES))], s
        assert mask.any(), f"dead end at {s}"
        todo += [g.advance(s, int(t)) for t in np.flatnonzero(mask)]


def test_anchors_are_allowed_and_change_nothing_in_a_full_match() -> None:
    for anchored, plain in (("^[0-9]+$", "[0-9]+"), ("a|^b", "a|b"), ("^(ab|c)$", "(ab|c)")):
        g, h = VOCAB.grammar(anchored), VOCAB.grammar(plain)
        assert texts_of(g, g.start(), 3) == texts_of(h, h.start(), 3), anchored


def test_the_mask_cache_is_bounded() -> None:
    from treedraft.text_grammar import MAX_MASKS

    g = VOCAB.grammar("a{0,700}")  # every position a new state
    s, a = g.start(), PIECES.index(b"a")
    for _ in range(700):
        assert g.allowed(s)[a]
        s = g.advance(s, a)
    assert len(g._masks) == MAX_MASKS and g.allowed(s).tolist() == [True] + [False] * (len(PIECES) - 1)


def test_split_characters_are_taken_only_towards_an_allowed_character() -> None:
    """The first byte of "é" is refused where only "€" may come (the answer would dead-end mid-character), taken
    where "é" may, and EOS waits for the character to be complete."""
    g = VOCAB.grammar("x(é|€)y")
    s = g.advance(g.start(), PIECES.index(b"x"))
    half_e, half_euro = PIECES.index("é".encode()[:1]), PIECES.index("€".encode()[:2])
    assert g.allows(s, half_e) and g.allows(s, half_euro)
    only_euro = VOCAB.grammar("x€y")
    assert not only_euro.allows(only_euro.advance(only_euro.start(), PIECES.index(b"x")), half_e)
    e = VOCAB.grammar("é")
    mid = e.advance(e.start(), half_e)
    assert mid is not None and not e.allows(mid, EOS)
    end = e.advance(mid, PIECES.index("é".encode()[1:]))
    assert e.allows(end, EOS) and e.allowed(end).tolist() == [True] + [False] * (len(PIECES) - 1)
    assert e.advance(e.advance(end, EOS), EOS) == DONE  # a row past an accepted EOS may only take EOS again


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet="abc.*+?()[]|\\^$-", min_size=1, max_size=5), min_size=1, max_size=4))
def test_a_choice_is_exactly_one_of_its_strings(choices: list[str]) -> None:
    """Any strings, regex metacharacters included, are matched literally."""
    rx = choice_pattern(choices)
    assert all(re.fullmatch(rx, c) for c in choices)
    p = full_match(rx)
    for c in choices:
        d = 0
        for ch in c:
            d = p.next(d, ord(ch))
        assert d >= 0 and p.accepts(d)
    assert escape("a.b") == "a\\.b"


def test_bad_expressions_and_choices_are_named() -> None:
    with pytest.raises(ValueError, match=r"regex 'ok\[': missing '\]'"):
        full_match("ok[")
    with pytest.raises(ValueError, match="unexpected '\\)'"):  # not wrapped into "(?:a)|(?:b)": a different regex
        full_match("a)|(?:b")
    with pytest.raises(ValueError, match=r"regex 'xxxxx.*\.\.\.': missing"):  # a long expression is shortened
        full_match("x" * 200 + "[")
    with pytest.raises(ValueError, match="lookaround"):
        full_match("(?=a)b")
    for bad in ([], [""], "yes", [1]):
        with pytest.raises(ValueError, match="non-empty list"):
            choice_pattern(bad)


def test_speculative_equals_plain_under_a_regex_and_the_answer_matches() -> None:
    """Tiny model, greedy and seeded: every drafter's output equals plain's under the same constraint, and the
    answer is a full match."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    for kw in (dict(regex="(ab|b)+c?"), dict(choice=["bab", "cab", "abc abc"]), dict(regex="[a-c ]{3,9}")):
        for sampling in (dict(), dict(temperature=1.0, seed=4)):
            plain = llm.generate("abc abc", max_new_tokens=16, drafter=None, **kw, **sampling)
            rx = kw.get("regex") or choice_pattern(kw["choice"])
            assert plain.finish_reason == "length" or re.fullmatch(rx, plain.text), (kw, plain.text)
            for d in ("prompt-lookup", "suffix"):
                out = llm.generate("abc abc", max_new_tokens=16, drafter=d, **kw, **sampling)
                assert out.token_ids == plain.token_ids, (kw, sampling, d)
    with pytest.raises(ValueError, match="give one of response_format / regex"):
        llm.generate("abc", regex="a", response_format="json_object")


@pytest.mark.slow
def test_real_model_default_drafter_under_a_regex_and_a_choice_equals_plain(smollm_int4) -> None:
    llm = smollm_int4
    q = "Is the sentiment of 'the food was cold and late' positive or negative? Answer, then say why."
    for kw in (dict(choice=["positive", "negative"]), dict(regex="(Positive|Negative)\\. [A-Z][a-z ,]+\\.")):
        plain = llm.generate(q, max_new_tokens=40, drafter=None, **kw)
        rx = kw.get("regex") or choice_pattern(kw["choice"])
        assert plain.finish_reason == "stop" and re.fullmatch(rx, plain.text), plain.text
        assert llm.generate(q, max_new_tokens=40, **kw).token_ids == plain.token_ids


def test_a_cached_automaton_is_not_held_up_by_another_requests_compile(monkeypatch) -> None:
    """The server's event loop asks for a request's automaton (cached by then) while a tokenizer thread compiles
    another one: the compile runs outside the cache lock, so the cached one comes back at once (before, the whole
    build held the lock and stalled the event loop)."""
    import os
    import sys
    import threading
    import time

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    from treedraft import text_grammar

    llm = tiny_llm()
    cached = llm.text_grammar("a+")
    llm.json_grammar("json_object")
    real, release, started = text_grammar.TextVocab.grammar, threading.Event(), threading.Event()

    def slow(self, regex):
        if regex == "b+":
            started.set()
            release.wait(30)
        return real(self, regex)

    monkeypatch.setattr(text_grammar.TextVocab, "grammar", slow)
    t = threading.Thread(target=llm.text_grammar, args=("b+",), daemon=True)
    t.start()
    try:
        assert started.wait(10)
        t0 = time.perf_counter()
        assert llm.text_grammar("a+") is cached and llm.json_grammar("json_object") is not None
        assert time.perf_counter() - t0 < 2.0, "waited on the other compile"
    finally:
        release.set()
        t.join(30)
    assert llm.text_grammar("b+").pattern.accepts(llm.text_grammar("b+").pattern.next(0, ord("b")))


def test_stop_token_ids_are_refused_next_to_a_constraint() -> None:
    """A stop id would end a constrained answer before it is complete (the automaton ends only at EOS): refused,
    as min_tokens is."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    from treedraft.interfaces import GenerationError

    llm = tiny_llm()
    for kw in (dict(regex="b+"), dict(choice=["bb"]), dict(response_format="json_object")):
        with pytest.raises(GenerationError, match="stop_token_ids cannot be combined with a constrained answer"):
            llm.generate("abc abc", max_new_tokens=4, stop_token_ids=[66], **kw)


def test_a_regex_no_token_can_begin_is_refused_when_built() -> None:
    """A review (session 44): the request failed mid-generation, naming token 0; now the build says what is wrong."""
    for regex in ("[一-鿿]+", "Ω|ΩΩ"):  # characters whose first byte no token of this vocabulary has
        with pytest.raises(ValueError, match="no token begins one"):
            VOCAB.grammar(regex)
    assert VOCAB.grammar("a*").allowed((0, b""))[EOS]  # an empty answer may end at once
