"""The text layer on tiny models and tiny in-memory tokenizers: max tokens, EOS, stop strings across
token boundaries, multi-byte UTF-8 split across tokens, and step stats capped at what was delivered."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from spec_stats import one_thread  # noqa: F401 (fixture)
from test_engine import ChainDrafter, RandomTreeDrafter, cfg, reference_greedy
from tokenizers import AddedToken, Tokenizer, decoders, models

from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import Engine, GenerationStats, StepStats
from treedraft.models.callable_target import CallableTarget
from treedraft.text import StopChecker, StreamDetokenizer, TextGenerator

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHABET = "abcdefghijklmnop"


class TinyTokenizer:
    """What the text layer needs: a ``tokenizers`` backend and the EOS ids."""

    def __init__(self, backend: Tokenizer, eos: Sequence[int] = ()) -> None:
        self.backend, self.eos_token_ids = backend, frozenset(eos)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def char_tokenizer(eos: int | None = None) -> TinyTokenizer:
    """One letter per token (ids 0..15 = a..p); ``eos`` is a special token that decodes to nothing."""
    t = Tokenizer(models.WordLevel({c: i for i, c in enumerate(ALPHABET)}, unk_token="a"))
    t.decoder = decoders.Fuse()
    if eos is not None:
        t.add_special_tokens([AddedToken(ALPHABET[eos], special=True)])
    return TinyTokenizer(t, () if eos is None else (eos,))


def byte_tokenizer() -> TinyTokenizer:
    """Each token is one UTF-8 byte (byte-fallback tokens), so multi-byte characters span tokens."""
    t = Tokenizer(models.WordLevel({f"<0x{i:02X}>": i for i in range(256)}, unk_token="<0x00>"))
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return TinyTokenizer(t)


# ---- max tokens, EOS, stop strings ---------------------------------------------------------
def test_max_new_tokens_exact_with_speculation() -> None:
    model, prompt, ref = reference_greedy()
    gen = TextGenerator(Engine(model), char_tokenizer())
    for n in (1, 2, 3, 5, 8, 13, 30):
        for depth in (1, 4, 9):
            r = gen.generate(prompt, cfg(n), ChainDrafter(prompt + ref, depth))
            assert r.token_ids == ref[:n] and r.finish_reason == "length" and r.stats.new_tokens == n
            assert r.text == "".join(ALPHABET[t] for t in ref[:n])


def test_eos_stops_and_ignore_eos_continues() -> None:
    model, prompt, ref = reference_greedy()
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    eos = ref[k]
    gen = TextGenerator(Engine(model), char_tokenizer(eos))
    for drafter in (None, ChainDrafter(prompt + ref, 6), RandomTreeDrafter(16, 0, prompt + ref)):
        r = gen.generate(prompt, cfg(30, ignore_eos=False), drafter)
        assert r.token_ids == ref[: k + 1] and r.finish_reason == "stop"
        assert r.text == "".join(ALPHABET[t] for t in ref[:k])  # the EOS id is returned, its text never
        assert r.stats.new_tokens == k + 1
        r = gen.generate(prompt, cfg(30, ignore_eos=True), drafter)
        assert r.token_ids == ref and r.finish_reason == "length"


def test_stop_strings_across_token_boundaries() -> None:
    model, prompt, ref = reference_greedy()
    tok = char_tokenizer()
    text = tok.decode(ref)
    gen = TextGenerator(Engine(model), tok)
    for k in (2, 7, 15):
        for stop in (text[k : k + 2], text[k : k + 3]):  # every stop string spans 2-3 tokens
            idx = text.find(stop)
            for drafter in (None, ChainDrafter(prompt + ref, 8)):
                chunks = list(gen.stream(prompt, cfg(30, stop=("never-seen", stop)), drafter))
                ids = [t for c in chunks for t in c.token_ids]
                assert "".join(c.text for c in chunks) == text[:idx]  # the stop string is never emitted
                assert ids == ref[: idx + len(stop)]  # stops at the token that completes the stop string
                assert chunks[-1].finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])


def test_stop_checker_cuts_at_earliest_stop_and_holds_partial_matches() -> None:
    s = StopChecker(["C", "AB"])
    assert s.feed("xxABCyy") == ("xx", True)  # "AB" starts first although "C" is listed first
    s = StopChecker(["STOP"])
    assert s.feed("abcST") == ("abc", False)  # "ST" might become STOP: held back
    assert s.feed("x") == ("STx", False)
    assert s.feed("ST") == ("", False) and s.feed("OP!") == ("", True)


# ---- accepted counts are capped at what was delivered --------------------------------------
@pytest.mark.parametrize("how", ["eos", "stop"])
def test_accepted_drafts_cut_by_eos_or_stop_are_not_counted(how: str) -> None:
    model, prompt, ref = reference_greedy()
    depth = 6  # every step accepts 6 right drafts + the bonus: steps cover outputs [1, 8), [8, 15), ...
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and (i - 1) % (depth + 1) < depth - 1)
    if how == "eos":
        gen, config = TextGenerator(Engine(model), char_tokenizer(ref[k])), cfg(30, ignore_eos=False)
    else:
        tok = char_tokenizer()
        gen, config = TextGenerator(Engine(model), tok), cfg(30, stop=(tok.decode(ref[k - 1 : k + 1]),))
        assert tok.decode(ref).find(config.stop[0]) == k - 1
    r = gen.generate(prompt, config, ChainDrafter(prompt + ref, depth))
    assert r.token_ids == ref[: k + 1] and r.finish_reason == "stop"
    steps = r.stats.steps
    delivered_last = k + 1 - (1 + (depth + 1) * (len(steps) - 1))  # tokens of the last step that were emitted
    assert 1 <= delivered_last < depth  # the cut falls inside the last step's drafts
    assert [s.accepted for s in steps[:-1]] == [depth] * (len(steps) - 1)
    assert steps[-1].accepted == delivered_last  # not the 6 the verifier accepted
    assert r.stats.new_tokens == k + 1 and r.stats.accepted_tokens <= r.stats.new_tokens - 1


def test_stats_cut_caps_the_last_step() -> None:
    st = GenerationStats(new_tokens=9, steps=[StepStats(5, 4, 4, 0, 0, 0), StepStats(5, 4, 3, 0, 0, 0)])
    st.cut(9)  # nothing cut
    assert [s.accepted for s in st.steps] == [4, 3] and st.new_tokens == 9
    st.cut(7)  # the last step delivered 2 of its 4 tokens (3 drafts + bonus)
    assert [s.accepted for s in st.steps] == [4, 2] and st.new_tokens == 7


# ---- streaming detokenization ----------------------------------------------------------------
def test_stream_detokenizer_holds_split_multibyte_characters() -> None:
    text = "a é 中文 😀!\n¿ok? 🎉🎉"
    ids = list(text.encode("utf-8"))
    dec = StreamDetokenizer(byte_tokenizer().backend)
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    # the 4 bytes of 😀: nothing until the last one, then the whole character
    start = text.encode("utf-8").index("😀".encode())
    assert pieces[start : start + 4] == ["", "", "", "😀"]
    # a truncated character at the end comes out of flush (as replacement characters), nothing else lost
    dec = StreamDetokenizer(byte_tokenizer().backend)
    assert "".join(dec.push(t) for t in "x中".encode()[:-1]) == "x"
    tail = dec.flush()
    assert tail and set(tail) == {"\ufffd"}


def _byte_target(answer: bytes) -> CallableTarget:
    """A target that deterministically continues any context with ``answer`` (then repeats its last byte)."""

    def fn(tokens: list[int]) -> dict[int, float]:
        n = len(tokens) - 2  # the prompt is 2 bytes
        return {answer[min(n, len(answer) - 1)]: 1.0}

    return CallableTarget(fn, vocab_size=256, max_workers=1)


@pytest.mark.parametrize("drafter", [None, "lookup"])
def test_generated_multibyte_characters_stream_whole(drafter: str | None) -> None:
    text = "ok 中文 😀😀 é. 中文 😀😀 é."
    answer = text.encode("utf-8")
    gen = TextGenerator(Engine(_byte_target(answer)), byte_tokenizer())
    d = PromptLookupDrafter() if drafter else None
    stats = GenerationStats()
    chunks = list(gen.stream([1, 2], cfg(len(answer)), d, stats))
    assert [t for c in chunks for t in c.token_ids] == list(answer)
    assert "".join(c.text for c in chunks) == text and chunks[-1].finish_reason == "length"
    assert all("\ufffd" not in c.text for c in chunks)
    assert "😀" in [c.text for c in chunks]  # one chunk carries the whole 4-byte character
    if drafter:
        assert stats.accepted_tokens > 0  # the repeat was drafted across character boundaries
    # a stop string that is one multi-byte character, split over 3 tokens
    r = gen.generate([1, 2], cfg(len(answer), stop=("文",)), d)
    assert r.text == "ok 中" and r.finish_reason == "stop"
    assert bytes(r.token_ids) == "ok 中文".encode()


# ---- the drafter hears when a request ends, with only the delivered tokens -----------------
class RecordingChain(ChainDrafter):
    """A chain drafter that keeps what ``finish`` was told."""

    def __init__(self, oracle: Sequence[int], depth: int) -> None:
        super().__init__(oracle, depth)
        self.finished: list[tuple[list[int], list[int]]] = []

    def finish(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.finished.append((list(prompt_ids), list(output_ids)))


@pytest.mark.parametrize("how", ["eos", "stop", "length", "hybrid"])
def test_finish_gets_exactly_the_delivered_tokens(how: str) -> None:
    from treedraft.drafters.hybrid import HybridDrafter

    model, prompt, ref = reference_greedy()
    depth = 6  # the stop falls inside a step's accepted drafts: the drafts after it were never delivered
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and (i - 1) % (depth + 1) < depth - 1)
    tok = char_tokenizer(ref[k] if how in ("eos", "hybrid") else None)
    config = {
        "eos": cfg(30, ignore_eos=False),
        "hybrid": cfg(30, ignore_eos=False),
        "length": cfg(30),
        "stop": cfg(30, stop=(tok.decode(ref[k - 1 : k + 1]),)),
    }[how]
    d = RecordingChain(prompt + ref, depth)
    gen = TextGenerator(Engine(model), tok)
    r = gen.generate(prompt, config, HybridDrafter([d]) if how == "hybrid" else d)
    want = ref if how == "length" else ref[: k + 1]
    assert r.token_ids == want and d.finished == [(prompt, want)]
    # a consumer that walks away mid-stream: what it took is recorded, once
    d.finished.clear()
    s = gen.stream(prompt, cfg(30), d)
    took = [t for _, c in zip(range(3), s) for t in c.token_ids]
    s.close()
    assert d.finished == [(prompt, took)]


def test_the_stop_string_met_first_wins_however_the_text_is_split() -> None:
    """A review (session 44): with stops "bc" and "abcd", "abcd" in one token cut at "" (the earliest start) but
    token by token at "a": generation meets "bc" first, so the answer is "a" either way."""
    for pieces in (["abcd"], list("abcd"), ["ab", "cd"]):
        sc = StopChecker(["bc", "abcd"])
        out, hit = "", False
        for p in pieces:
            text, hit = sc.feed(p)
            out += text
            if hit:
                break
        assert (out, hit) == ("a", True), pieces
