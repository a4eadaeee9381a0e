"""The one decode loop: prefill -> propose -> verify -> accept, in token ids.

Plain decoding is the same loop with an empty tree (root only). :meth:`Engine.decode` yields the
token ids each step commits and records step stats; it stops only at the token budget.
Detokenization, stop strings and EOS live in :mod:`treedraft.text`, which wraps this loop for the
CLI, the API and the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .grammar import JsonGrammar
from .interfaces import DraftContext, Drafter, GenerationError, TargetModel, target_device
from .logprobs import TokenLogprob, check_top
from .penalties import Penalties
from .sampling import SamplingParams
from .text_grammar import TextGrammar
from .tree import TokenTree, TreeError
from .verify import RULES

__all__ = [
    "DecodeResult",
    "DraftContext",
    "Drafter",
    "Engine",
    "GenerationConfig",
    "GenerationError",
    "GenerationStats",
    "StepStats",
    "TargetModel",
    "acceptance_per_depth",
    "target_device",
]

log = logging.getLogger("treedraft.engine")

Q_SUM_TOLERANCE = 1e-3  # |sum(child_q) - 1| allowed for a drafter's draft distribution (float32 over a large vocab)


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request. ``stop`` and ``ignore_eos`` are read by the text layer (:mod:`treedraft.text`)."""

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rule: str = "speculative"  # greedy params always verify greedily; see verify.RULES
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    max_tree_nodes: int = 64
    logprobs: int | None = None  # None: off; n: each token's log p and its row's n best (treedraft.logprobs)
    penalties: Penalties = field(default_factory=Penalties)  # repetition / presence / frequency (treedraft.penalties)
    # JSON mode (treedraft.grammar) or a regex / choice (treedraft.text_grammar): the automaton over the vocabulary
    grammar: JsonGrammar | TextGrammar | None = None
    # predicted output (OpenAI's "prediction"): token ids the answer is expected to resemble; text drafters search
    # them as well (DraftContext.reference). Speed only: the output is the same with or without them.
    prediction: tuple[int, ...] = ()
    # more token ids that end the answer as EOS does (vLLM's stop_token_ids; kept with ignore_eos too)
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise GenerationError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.rule not in RULES:
            raise GenerationError(f"unknown acceptance rule {self.rule!r}; choose one of {RULES}")
        if self.rule == "greedy" and not self.sampling.greedy:
            raise GenerationError("acceptance rule 'greedy' needs temperature 0; use 'speculative' or 'typical'")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if self.max_tree_nodes < 1:
            raise GenerationError(f"max_tree_nodes must be >= 1, got {self.max_tree_nodes}")
        if self.penalties.min_tokens > self.max_new_tokens:
            raise GenerationError(
                f"min_tokens ({self.penalties.min_tokens}) is more than the answer's token limit "
                f"({self.max_new_tokens}: max_new_tokens, the server's max_tokens)"
            )
        try:
            check_top(self.logprobs)
        except ValueError as err:
            raise GenerationError(str(err)) from None
        if self.grammar is not None and self.ignore_eos:
            raise GenerationError(
                "a constrained answer (JSON mode, a regex or a choice) ends with EOS once it is complete; "
                "drop ignore_eos"
            )
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.prediction):
            raise GenerationError("prediction must be a sequence of token ids (integers >= 0)")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be token ids (integers >= 0), got {list(self.stop_token_ids)}")
        if self.grammar is not None and self.stop_token_ids:
            raise GenerationError(
                "stop_token_ids cannot be combined with a constrained answer (JSON mode, a regex or a choice): a stop "
                "id could end it before it is complete; the complete answer ends with EOS"
            )
        if self.grammar is not None and self.penalties.min_tokens > 0:
            raise GenerationError(
                "min_tokens cannot be combined with a constrained answer (JSON mode, a regex or a choice): the "
                "complete answer ends it"
            )


def acceptance_per_depth(steps: Iterable[tuple[int, int]]) -> list[float]:
    """P(accepted >= d | tree depth >= d) for d = 1..max depth, pooled over (tree_depth, accepted) steps.

    ``accepted`` counts draft tokens only (bonus excluded). Shared by :class:`GenerationStats`
    and the benchmark, which pools the steps of many generations.
    """
    steps = list(steps)
    depth = max((d for d, _ in steps), default=0)
    out = []
    for d in range(1, depth + 1):
        tried = [a for dd, a in steps if dd >= d]
        out.append(sum(a >= d for a in tried) / len(tried))
    return out


@dataclass
class StepStats:
    """One verify step."""

    tree_size: int  # nodes verified, root included
    tree_depth: int
    accepted: int  # draft tokens accepted and delivered (bonus not counted)
    t_draft: float
    t_verify: float
    t_rest: float


@dataclass
class GenerationStats:
    """Counts and timings of one generation (filled in by :meth:`Engine.decode`)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    t_prefill: float = 0.0
    t_decode: float = 0.0
    steps: list[StepStats] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step, bonus token included (1.0 for plain decoding)."""
        return sum(s.accepted + 1 for s in self.steps) / max(1, len(self.steps))

    @property
    def drafted_tokens(self) -> int:
        """Draft tokens verified (tree nodes other than the roots)."""
        return sum(s.tree_size - 1 for s in self.steps)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted and delivered."""
        return sum(s.accepted for s in self.steps)

    def acceptance_per_depth(self) -> list[float]:
        """P(accepted depth >= d | tree reached depth d), d = 1..max depth."""
        return acceptance_per_depth((s.tree_depth, s.accepted) for s in self.steps)

    def __repr__(self) -> str:  # a summary: the per-step list (``steps``) is hundreds of entries
        return (
            f"GenerationStats(prompt_tokens={self.prompt_tokens}, new_tokens={self.new_tokens}, "
            f"steps={len(self.steps)}, mean_accepted_length={self.mean_accepted_length:.2f}, "
            f"tokens_per_s={self.tokens_per_s:.1f}, t_prefill={self.t_prefill:.3f}, t_decode={self.t_decode:.3f})"
        )

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of decoding: the new tokens after the first (the prefill's, its time in ``t_prefill``)
        over ``t_decode``; 0.0 with fewer than two (a review, session 44: counting the first made a one-token answer
        read ~10^6 tok/s in the server's metrics, and every rate n / (n - 1) too high)."""
        return (self.new_tokens - 1) / self.t_decode if self.new_tokens > 1 and self.t_decode > 0 else 0.0

    def cut(self, delivered: int) -> None:
        """Only the first ``delivered`` new tokens reached the user (EOS, stop string): forget the rest.

        The cut tokens all come from the last step yielded; its ``accepted`` is capped at the draft
        tokens of that step that were delivered, so cut drafts never count as accepted.
        """
        excess = self.new_tokens - delivered
        if excess <= 0:
            return
        self.new_tokens = delivered
        if self.steps:
            last = self.steps[-1]
            last.accepted = max(0, min(last.accepted, last.accepted + 1 - excess))


@dataclass
class DecodeResult:
    """Token ids of a finished :meth:`Engine.generate` (stopped by the token budget) and its stats."""

    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the config asked for them


class Engine:
    """Runs the decode loop for one target model, optionally with a default drafter.

    One stream at a time on its one KV cache: a stream started from another thread waits until this thread's open
    streams have finished (or were closed), and gives up with a RuntimeError when they have not stepped for
    :attr:`IDLE_WAIT_S` (a stream left open, never finished); two interleaved streams of one thread fail the older one
    clearly. For many requests at once, the batched :class:`~treedraft.scheduler.Scheduler` (what ``treedraft serve``
    runs).
    """

    IDLE_WAIT_S = 30.0  # how long another thread's open streams may go without a step before a waiter gives up

    def __init__(self, model: TargetModel, drafter: Drafter | None = None) -> None:
        self.model = model
        self.drafter = drafter
        self._cache = None
        self._cache_owner: object | None = None  # token of the stream that currently holds self._cache
        # streams of one thread at a time: another thread's decode waits until this thread's streams are done (they
        # share the one KV cache; two threads stepping at once returned one request's tokens to the other)
        self._turn = threading.Condition()
        self._holder: int | None = None  # the thread whose streams are open
        self._open = 0  # its open streams
        self._stepped = 0.0  # time.monotonic() of their last step

    def _enter(self) -> None:
        me = threading.get_ident()
        with self._turn:
            while self._holder is not None and self._holder != me:
                idle = time.monotonic() - self._stepped
                if idle > self.IDLE_WAIT_S:
                    raise RuntimeError(
                        f"another thread's stream on this LLM has been open for {idle:.0f} s without a step; finish or "
                        "close it (stream.close()) first: an LLM decodes one answer at a time (for many at once, "
                        "treedraft serve batches them)"
                    )
                self._turn.wait(min(1.0, self.IDLE_WAIT_S))
            self._holder, self._open = me, self._open + 1
            self._stepped = time.monotonic()

    def _leave(self) -> None:
        with self._turn:
            self._open -= 1
            if self._open == 0:
                self._holder = None
                self._turn.notify_all()

    @property
    def device(self) -> torch.device:
        """Where the target's inputs are built (read from the model each time: it may be moved)."""
        return target_device(self.model)

    def _cache_for(self, owner: object) -> object:
        """Hand the (single, reused) KV cache to the stream ``owner``; any earlier stream loses it."""
        if self._cache is None:
            self._cache = self.model.new_cache(self.model.max_seq_len)
        self._cache.length = 0
        self._cache_owner = owner
        return self._cache

    def _check_owner(self, owner: object) -> None:
        if self._cache_owner is not owner:
            raise RuntimeError(
                "this generation's KV cache was taken by another stream started on the same Engine "
                "(e.g. two interleaved stream() generators); an Engine runs one stream at a time: "
                "finish or close one stream before starting the next, or use one Engine per stream"
            )

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise GenerationError when the prompt cannot be served."""
        if len(prompt_ids) == 0:
            raise GenerationError("the prompt is empty; give at least one token of text")
        limit = self.model.max_seq_len
        if len(prompt_ids) >= limit:
            raise GenerationError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {limit}; "
                f"shorten it to at most {limit - 1} tokens"
            )
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.model.vocab_size]
        if bad:
            raise GenerationError(f"prompt token ids out of range [0, {self.model.vocab_size}): {bad[:5]}")

    def token_budget(self, prompt_len: int, config: GenerationConfig) -> int:
        """How many new tokens :meth:`decode` produces at most: max_new_tokens capped by the context left."""
        return min(config.max_new_tokens, self.model.max_seq_len - prompt_len)

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None | str = "default",
    ) -> DecodeResult:
        """Decode to the token budget (no EOS, no stop strings: see :class:`treedraft.text.TextGenerator`)."""
        stats = GenerationStats()
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        for step in self.decode(prompt_ids, config, drafter, stats):
            ids += step
            lps += getattr(step, "logprobs", None) or []
        return DecodeResult(ids, "length", stats, lps if config is not None and config.logprobs is not None else None)

    @torch.inference_mode()
    def decode(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None | str = "default",
        stats: GenerationStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield the token ids each step commits: the prefill's token, then accepted drafts + bonus per step.

        ``drafter``: "default" (the engine's), None (plain decoding) or a drafter. Stops after
        :meth:`token_budget` tokens; a consumer that stops earlier (EOS, stop string) closes the
        generator and calls ``stats.cut``. ``stats`` is updated before each yield. When the generation
        ends (either way), a drafter with ``finish(prompt_ids, output_ids)`` gets the delivered tokens.
        This is the one-request case of the batched loop (:class:`treedraft.scheduler.Scheduler`), on the
        engine's reused KV cache, with the server's prefill: on a model with a native decoder the prompt runs
        through it in chunks of ``native_prefill_rows`` (faster than the Python whole-prompt prefill, and the same
        arithmetic as ``treedraft serve``, so the CLI's greedy text is the server's); else whole, in Python.
        """
        from .scheduler import Scheduler

        owner = object()  # ownership token: a stream resumed after another one took the cache must not run on
        self.check_prompt(prompt_ids)
        native = getattr(self.model, "native_prefill_rows", None)
        rows = native() if callable(native) else None
        self._enter()  # another thread's streams finish first (one KV cache)
        try:
            sched = Scheduler(self, prefill_chunk=rows, native_prefill=rows is not None)
            req = sched.add(prompt_ids, config, drafter, stats, cache=self._cache_for(owner))
        except BaseException:
            self._leave()
            raise
        try:
            while not req.done:
                self._check_owner(owner)
                self._stepped = time.monotonic()
                for r, new in sched.step():
                    if r.error is not None:
                        raise r.error
                    yield new
        finally:  # exhausted, or closed by a consumer that stopped early (EOS, stop string, client gone)
            # stats.cut() has already capped new_tokens at what was delivered: only those are recorded
            try:
                sched.remove(req)
            finally:
                self._leave()

    @staticmethod
    def _finish(drafter: Drafter | None, prompt: list[int], output: list[int]) -> None:
        """Tell a drafter that keeps state across requests (``finish``, e.g. ``suffix``) that this one ended."""
        fin = getattr(drafter, "finish", None)
        if not callable(fin):
            return
        try:
            fin(prompt, output)
        except Exception:  # the tokens are already delivered: log it, never fail the request
            log.exception(
                "drafter %r failed to record a finished request", getattr(drafter, "name", type(drafter).__name__)
            )

    @staticmethod
    def _check_tree(tree: TokenTree, root: int, vocab: int, name: str) -> None:
        """Reject a drafter's tree the acceptance rules cannot verify soundly, naming the drafter."""
        if not isinstance(tree, TokenTree):
            raise TreeError(f"drafter {name!r} returned {type(tree).__name__}, expected a TokenTree")
        if tree.tokens[0] != root:
            raise TreeError(f"drafter {name!r} returned a tree rooted at {tree.tokens[0]}, expected root {root}")
        bad = [t for t in tree.tokens if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise TreeError(
                f"drafter {name!r} proposed token ids outside the vocabulary [0, {vocab}) (or not ints): {bad[:5]}"
            )
        kids = tree.children()
        for node, q in tree.child_q.items():
            if (
                not (isinstance(node, int) and 0 <= node < len(tree))
                or not isinstance(q, Tensor)
                or tuple(q.shape) != (vocab,)
            ):
                raise TreeError(
                    f"drafter {name!r} gave child_q[{node!r}] that is not a ({vocab},) tensor "
                    f"for a node of its {len(tree)}-node tree"
                )
            # the lossless multi-draft rule divides by q: an unnormalised q biases the output distribution
            qd = q.detach().double()
            total = float(qd.sum())
            if not bool(torch.isfinite(qd).all()) or bool((qd < 0).any()) or abs(total - 1.0) > Q_SUM_TOLERANCE:
                raise TreeError(
                    f"drafter {name!r} gave child_q[{node}] that is not a probability distribution "
                    f"(min {float(qd.min()):.3g}, sum {total:.6g}); it must be the normalised "
                    f"distribution the children were sampled from (q >= 0, sum 1 within "
                    f"{Q_SUM_TOLERANCE})"
                )
            if any(float(q[tree.tokens[c]]) <= 0.0 for c in kids[node]):
                raise TreeError(
                    f"drafter {name!r} sampled children of node {node} that have zero probability "
                    "under its own child_q; its q must be the distribution it sampled from"
                )
