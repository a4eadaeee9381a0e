"""The text layer: streaming detokenization, stop strings and EOS around the token-id engine.

:class:`TextGenerator` wraps an :class:`~treedraft.engine.Engine` for the CLI, the Python API and
the server: it turns the token ids each step commits into :class:`Chunk` s of text, ends the
generation at an EOS token or a stop string (never emitting the stop string), and caps the step
stats at what was delivered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from .engine import Engine, GenerationConfig, GenerationStats
from .interfaces import Drafter
from .logprobs import TokenLogprob


class TextTokenizer(Protocol):
    """What the text layer needs from a tokenizer (see :class:`treedraft.tokenizer.Tokenizer`)."""

    eos_token_ids: frozenset[int]

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` whose decoder turns ids into text."""
        ...


class StreamDetokenizer:
    """Incremental detokenizer on ``tokenizers.decoders.DecodeStream``: emits text only once it is stable.

    A multi-byte UTF-8 character split across tokens comes out whole, with its last token;
    :meth:`flush` returns whatever is still held back (a truncated character as U+FFFD).
    """

    def __init__(self, backend: Any, skip_special_tokens: bool = True) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._held = 0  # ids pushed since text last came out

    def push(self, token: int) -> str:
        """Add one token id; return the newly stable text (may be empty)."""
        token = int(token)
        self._ids.append(token)
        out = self._stream.step(self.backend, token)
        if not out:
            self._held += 1
            return ""
        self._held = 0
        self._emitted.append(out)
        return out

    def flush(self) -> str:
        """The text still held back (e.g. a character whose last bytes never came); then start afresh."""
        if not self._held:
            return ""
        full = self.backend.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        done = "".join(self._emitted)
        tail = (
            full[len(done) :]
            if full.startswith(done)
            else self.backend.decode(self._ids[-self._held :], skip_special_tokens=self.skip_special_tokens)
        )
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._ids, self._emitted, self._held = [], [], 0
        return tail


class StopChecker:
    """Streams text while holding back any suffix that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, stop string hit)."""
        self.pending += text
        hits = [(i + len(s), i) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:  # cut at the stop string that ended first (the one generation met first; ties: the earlier start),
            # so the cut does not depend on how the text came in tokens (stops "bc", "abcd" on "abcd": "a" whole or
            # token by token, where the earliest start gave "" for one token and "a" for four)
            out = self.pending[: min(hits)[1]]
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """Everything held back (no stop string can complete any more)."""
        out, self.pending = self.pending, ""
        return out


@dataclass
class Chunk:
    """One streamed piece: new text (possibly empty) and the token ids behind it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos / stop string) or "length" on the last chunk
    logprobs: list[TokenLogprob] | None = None  # parallel to token_ids, when the request asked for them


@dataclass
class GenerationResult:
    """A finished generation: its text, token ids, why it ended and its stats."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    tool_calls: list[dict] | None = None  # LLM.generate with tools: the call (OpenAI's shape) the answer made


class TextGenerator:
    """An engine plus a tokenizer: text streaming, stop strings and EOS.

    ``tokenizer`` None: token ids only (every chunk's text is empty); ``eos_token_ids`` then
    default to none, else to the tokenizer's.
    """

    def __init__(
        self, engine: Engine, tokenizer: TextTokenizer | None = None, eos_token_ids: Sequence[int] | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None:
            eos_token_ids = tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(int(t) for t in (eos_token_ids or ()))

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None | str = "default",
    ) -> GenerationResult:
        """Run to completion; see :meth:`stream`."""
        stats = GenerationStats()
        texts, ids, reason, lps = [], [], "length", []
        for ch in self.stream(prompt_ids, config, drafter, stats):
            texts.append(ch.text)
            ids.extend(ch.token_ids)
            reason = ch.finish_reason or reason
            lps += ch.logprobs or []
        want = config is not None and config.logprobs is not None
        return GenerationResult("".join(texts), ids, reason, stats, lps if want else None)

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None | str = "default",
        stats: GenerationStats | None = None,
    ) -> Iterator[Chunk]:
        """Yield one :class:`Chunk` per token as tokens are committed; the last one has a finish_reason.

        Ends at an EOS token ("stop", the EOS id is in the chunk but not its text), at a stop string
        ("stop", text cut before it, the id that completed it included) or at the token budget
        ("length"). ``drafter``: "default" (the engine's), None (plain decoding) or a drafter; one with
        ``finish`` is told the prompt and the tokens delivered when the stream ends or is closed.
        """
        cfg = config or GenerationConfig()
        stats = stats if stats is not None else GenerationStats()
        text = self.text_stream(cfg, self.engine.token_budget(len(prompt_ids), cfg), stats)
        steps = self.engine.decode(prompt_ids, cfg, drafter, stats)
        delivered = 0  # tokens handed to our consumer
        try:
            for new in steps:
                for ch in text.feed(new):
                    delivered += 1
                    yield ch
                if text.done:
                    return
        finally:
            # a consumer that stops taking chunks mid-step (closes us) got only ``delivered`` tokens: the stats
            # and the drafter's record of this request (the engine's finish, run as it closes) cover only those
            stats.cut(delivered)
            steps.close()
        yield text.tail()  # not reached: the engine stops at the budget

    def text_stream(self, config: GenerationConfig, budget: int, stats: GenerationStats) -> TextStream:
        """The per-request text state for a request whose token ids come from elsewhere (the batched loop)."""
        return TextStream(self.tokenizer, self.ending_ids(config), config.stop, budget, stats)

    def ending_ids(self, config: GenerationConfig) -> frozenset[int]:
        """The token ids that end ``config``'s answer: EOS (unless ignore_eos) and its stop_token_ids."""
        eos = frozenset() if config.ignore_eos else self.eos_token_ids
        return eos | frozenset(config.stop_token_ids)


class TextStream:
    """One request's text state: feed it the token ids each step commits, get :class:`Chunk` s back.

    Ends (``done``) at an EOS id, a stop string or the token budget, with a final chunk that has a
    finish_reason; then ``stats.cut`` is applied for the drafts of that step that were never delivered.
    Push-style, so a batched loop can drive many of them (:class:`TextGenerator.stream` drives one).
    """

    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        eos: frozenset[int],
        stop: Sequence[str],
        budget: int,
        stats: GenerationStats,
    ) -> None:
        self.detok = StreamDetokenizer(tokenizer.backend) if tokenizer is not None else None
        self.stopper = StopChecker(stop)
        self.eos, self.budget, self.stats = eos, budget, stats
        self.n = 0  # tokens taken from the engine
        self.done = False

    def feed(self, new: Sequence[int]) -> list[Chunk]:
        """One chunk per token of ``new`` up to the final one (if this step ends the request)."""
        detok, stopper = self.detok, self.stopper
        out: list[Chunk] = []
        lps = getattr(new, "logprobs", None)  # a scheduler step's Committed ids carry them when asked for
        for i, tok in enumerate(new):
            if self.done:
                break
            self.n += 1
            lp = None if lps is None else [lps[i]]
            final = None
            if tok in self.eos:
                safe, hit = stopper.feed(detok.flush() if detok is not None else "")
                final = Chunk(safe + ("" if hit else stopper.flush()), [tok], "stop", lp)
            else:
                safe, hit = stopper.feed(detok.push(tok) if detok is not None else "")
                if hit:
                    final = Chunk(safe, [tok], "stop", lp)
                elif self.n >= self.budget:
                    safe2, hit2 = stopper.feed(detok.flush() if detok is not None else "")
                    final = Chunk(
                        safe + safe2 + ("" if hit2 else stopper.flush()), [tok], "stop" if hit2 else "length", lp
                    )
            if final is not None:
                self.stats.cut(self.n)  # drafts of this step after the final token were never delivered
                self.done = True
                out.append(final)
                break
            out.append(Chunk(safe, [tok], None, lp))
        return out

    def tail(self) -> Chunk:
        """A final chunk with whatever is held back (a stream that ended without a final token)."""
        self.done = True
        tail = self.detok.flush() if self.detok is not None else ""
        return Chunk(self.stopper.feed(tail)[0] + self.stopper.flush(), [], "length")
