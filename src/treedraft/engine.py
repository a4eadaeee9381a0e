"""The one decode loop: prefill -> propose -> verify -> accept -> stream.

Plain decoding is the same loop with an empty tree (root only). The CLI, the
server, the benchmark and the tests all drive :meth:`Engine.stream`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .sampling import SamplingParams, sample, target_probs
from .tree import TokenTree, TreeError, full_attention_mask, tree_positions
from .verify import RULES, accept


class GenerationError(ValueError):
    """Invalid generation request (empty prompt, too long, bad limits); the message names the limit."""


class TargetModel(Protocol):
    """What the engine needs from a target: see models/llama.py for the reference implementation.

    ``device`` is where the engine builds the inputs of ``forward`` (tokens, positions, mask).
    """

    vocab_size: int
    max_seq_len: int
    device: torch.device

    def new_cache(self, max_len: int | None = None): ...  # noqa: ANN201

    def forward(self, tokens: Tensor, positions: Tensor, cache=None, start: int | None = None,  # noqa: ANN001
                mask: Tensor | None = None, logits_for=None) -> tuple[Tensor, Tensor]: ...  # noqa: ANN001


def target_device(model: object) -> torch.device:
    """The device a target wants its inputs on: its ``device`` attribute, else its first parameter's, else cpu."""
    dev = getattr(model, "device", None)
    if dev is not None:
        return torch.device(dev)
    params = getattr(model, "parameters", None)
    if callable(params):
        p = next(iter(params()), None)
        if p is not None:
            return p.device
    return torch.device("cpu")


@dataclass
class DraftContext:
    """What a drafter sees each step."""

    tokens: list[int]  # prompt + generated so far; tokens[-1] is the root (chosen, not yet verified)
    hidden: Tensor | None  # (H,) target's final hidden state at the position that produced the root
    max_nodes: int  # tree size budget, root included
    max_depth: int  # deepest useful draft depth
    prompt_len: int = 0

    @property
    def root(self) -> int:
        return self.tokens[-1]


class Drafter(Protocol):
    """Proposes a tree rooted at ``ctx.root``. Never verifies."""

    name: str

    def propose(self, ctx: DraftContext) -> TokenTree: ...


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rule: str = "speculative"  # greedy params always verify greedily; see verify.RULES
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    max_tree_nodes: int = 64

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
    tree_size: int  # nodes verified, root included
    tree_depth: int
    accepted: int  # draft tokens accepted (bonus not counted)
    t_draft: float
    t_verify: float
    t_rest: float


@dataclass
class GenerationStats:
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
        return sum(s.tree_size - 1 for s in self.steps)

    @property
    def accepted_tokens(self) -> int:
        return sum(s.accepted for s in self.steps)

    def acceptance_per_depth(self) -> list[float]:
        """P(accepted depth >= d | tree reached depth d), d = 1..max depth."""
        return acceptance_per_depth((s.tree_depth, s.accepted) for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.t_decode if self.t_decode > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        return {"draft": sum(s.t_draft for s in self.steps), "verify": sum(s.t_verify for s in self.steps),
                "rest": sum(s.t_rest for s in self.steps)}


@dataclass
class Chunk:
    """One streamed piece: new text (possibly empty) and the token ids behind it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos / stop string) or "length" on the last chunk


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class _StopChecker:
    """Streams text while holding back any suffix that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, stop string hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:  # cut at the earliest stop string, whichever of them it is
            out = self.pending[: min(hits)]
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
        out, self.pending = self.pending, ""
        return out


class Engine:
    """Runs generation for one target model, optionally with a drafter."""

    def __init__(self, model: TargetModel, tokenizer=None, drafter: Drafter | None = None,  # noqa: ANN001
                 eos_token_ids: Sequence[int] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        if eos_token_ids is None and tokenizer is not None:
            eos_token_ids = tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self._cache = None
        self._cache_owner: object | None = None  # token of the stream that currently holds self._cache

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
            raise RuntimeError("this generation's KV cache was taken by another stream started on the same Engine "
                               "(e.g. two interleaved stream() generators); an Engine runs one stream at a time: "
                               "finish or close one stream before starting the next, or use one Engine per stream")

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise GenerationError when the prompt cannot be served."""
        if len(prompt_ids) == 0:
            raise GenerationError("the prompt is empty; give at least one token of text")
        limit = self.model.max_seq_len
        if len(prompt_ids) >= limit:
            raise GenerationError(f"the prompt has {len(prompt_ids)} tokens but the context window is {limit}; "
                                  f"shorten it to at most {limit - 1} tokens")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.model.vocab_size]
        if bad:
            raise GenerationError(f"prompt token ids out of range [0, {self.model.vocab_size}): {bad[:5]}")

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None,
                 drafter: Drafter | None | str = "default") -> GenerationResult:
        """Run to completion; see :meth:`stream`."""
        stats = GenerationStats()
        texts, ids, reason = [], [], "length"
        for ch in self.stream(prompt_ids, config, drafter, stats):
            texts.append(ch.text)
            ids.extend(ch.token_ids)
            reason = ch.finish_reason or reason
        return GenerationResult("".join(texts), ids, reason, stats)

    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None,
               drafter: Drafter | None | str = "default", stats: GenerationStats | None = None) -> Iterator[Chunk]:
        """Yield :class:`Chunk` s as tokens are committed. ``drafter=None`` is plain decoding."""
        cfg = config or GenerationConfig()
        drafter = self.drafter if drafter == "default" else drafter
        self.check_prompt(prompt_ids)
        stats = stats if stats is not None else GenerationStats()
        model, V = self.model, self.model.vocab_size
        prompt = [int(t) for t in prompt_ids]
        stats.prompt_tokens = len(prompt)
        gen = cfg.sampling.generator()  # a CPU generator: sampling draws on CPU, identical on every device
        dev = self.device
        owner = object()  # ownership token: a stream resumed after another one took the cache must not run on
        cache = self._cache_for(owner)
        decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        stopper = _StopChecker(cfg.stop)
        max_new = min(cfg.max_new_tokens, model.max_seq_len - len(prompt))

        t0 = time.perf_counter()
        logits, hidden = model.forward(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev),
                                       cache, 0, logits_for=slice(-1, None))
        cache.keep(0, range(len(prompt)))
        root = self._pick(logits[0, -1], cfg.sampling, gen)
        last_hidden = None if hidden is None else hidden[0, -1]
        stats.t_prefill = time.perf_counter() - t0
        t_start = time.perf_counter()
        tokens = prompt + [root]
        out: list[int] = []

        def emit(tok: int) -> Chunk | None:
            """Commit one output token; return the final chunk when generation ends here."""
            out.append(tok)
            stats.new_tokens = len(out)
            stats.t_decode = time.perf_counter() - t_start
            if tok in self.eos_token_ids and not cfg.ignore_eos:
                safe, hit = stopper.feed(decoder.flush() if decoder is not None else "")
                return Chunk(safe + ("" if hit else stopper.flush()), [tok], "stop")
            text = decoder.push(tok) if decoder is not None else ""
            safe, hit = stopper.feed(text)
            if hit:
                return Chunk(safe, [tok], "stop")
            if len(out) >= max_new:
                tail = decoder.flush() if decoder is not None else ""
                safe2, hit2 = stopper.feed(tail)
                return Chunk(safe + safe2 + ("" if hit2 else stopper.flush()), [tok], "stop" if hit2 else "length")
            pending.append(Chunk(safe, [tok]))
            return None

        pending: list[Chunk] = []
        to_emit = [root]  # accepted drafts + the bonus token of the last step (the next root)
        while True:
            final = None
            for tok in to_emit:
                final = emit(tok)
                if final is not None:
                    break
            yield from pending
            pending.clear()
            if final is not None:
                yield final
                return
            self._check_owner(owner)
            ts = time.perf_counter()
            budget = min(cfg.max_tree_nodes, model.max_seq_len - cache.length)
            max_depth = max_new - len(out) - 1
            if drafter is not None and budget > 1 and max_depth > 0:
                ctx = DraftContext(tokens, last_hidden, budget, max_depth, len(prompt))
                name = getattr(drafter, "name", type(drafter).__name__)
                try:
                    tree = drafter.propose(ctx)
                except TreeError as e:
                    raise TreeError(f"drafter {name!r} built a malformed tree: {e}") from e
                self._check_tree(tree, root, V, name)
                tree = tree.pruned_depth(max_depth).truncated(budget)
            else:
                tree = TokenTree((root,), (-1,))
            tv = time.perf_counter()
            start = cache.length
            n = len(tree)
            mask = None if n == 1 else full_attention_mask(tree, start, dev)
            logits, hidden = model.forward(torch.tensor([tree.tokens], device=dev), tree_positions(tree, start, dev),
                                           cache, start, mask)
            tr = time.perf_counter()
            if n == 1:
                acc_nodes, bonus = (0,), self._pick(logits[0, 0], cfg.sampling, gen)
            else:
                a = accept(cfg.rule, tree, logits[0], cfg.sampling, gen)
                acc_nodes, bonus = a.nodes, a.bonus
            cache.keep(start, list(acc_nodes))
            last_hidden = None if hidden is None else hidden[0, acc_nodes[-1]]
            new = [tree.tokens[i] for i in acc_nodes[1:]]
            tokens.extend(new)
            tokens.append(bonus)
            te = time.perf_counter()
            stats.steps.append(StepStats(n, max(tree.depths()), len(new), tv - ts, tr - tv, te - tr))
            to_emit = new + [bonus]
            root = bonus

    @staticmethod
    def _pick(logits: Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        if p.greedy:
            return int(logits.argmax())
        return sample(target_probs(logits[None], p)[0], gen)

    @staticmethod
    def _check_tree(tree: TokenTree, root: int, vocab: int, name: str) -> None:
        if not isinstance(tree, TokenTree):
            raise TreeError(f"drafter {name!r} returned {type(tree).__name__}, expected a TokenTree")
        if tree.tokens[0] != root:
            raise TreeError(f"drafter {name!r} returned a tree rooted at {tree.tokens[0]}, expected root {root}")
        bad = [t for t in tree.tokens if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise TreeError(f"drafter {name!r} proposed token ids outside the vocabulary [0, {vocab}) "
                            f"(or not ints): {bad[:5]}")
        kids = tree.children()
        for node, q in tree.child_q.items():
            if not (isinstance(node, int) and 0 <= node < len(tree)) or not isinstance(q, Tensor) \
                    or tuple(q.shape) != (vocab,):
                raise TreeError(f"drafter {name!r} gave child_q[{node!r}] that is not a ({vocab},) tensor "
                                f"for a node of its {len(tree)}-node tree")
            if any(float(q[tree.tokens[c]]) <= 0.0 for c in kids[node]):
                raise TreeError(f"drafter {name!r} sampled children of node {node} that have zero probability "
                                "under its own child_q; its q must be the distribution it sampled from")
