"""The one decode loop, batched: prefill -> propose -> verify -> accept for every active request per step.

A :class:`Scheduler` holds active requests (:class:`Request`: its own KV cache, sampling params and
seeded generator, acceptance rule, drafter, token budget). Each :meth:`Scheduler.step` runs ONE target
forward: every decoding request's drafter proposes a tree within a per-step row budget shared by the
batch (``step_rows``; trees shrink as the batch grows), a joining request contributes one prefill
chunk, all rows are packed into ``forward_packed`` (targets without it run one forward per request in
the same step), and each request applies its own acceptance rule, keeps its accepted path in its cache
and gets its new tokens. Requests join (:meth:`Scheduler.add`) and leave (:meth:`Scheduler.remove`)
between steps. :meth:`treedraft.engine.Engine.decode` is the one-request case of this loop.

Exactness: a request's prefill chunks and generator draws do not depend on the other requests, and its
greedy or seeded tokens do not depend on its trees, so with row-invariant linears (the native int4/int8
kernels) and exact attention a greedy request's tokens are bitwise those of the same request run alone, and
a seeded sampled request gives the same tokens alone or batched (the coupled lossless rule,
:func:`treedraft.verify.accept_coupled`; seeded typical acceptance keeps its ``max_tree_nodes``, see
:meth:`Scheduler._tree_budget`). With fp32 MKL linears a row's rounding depends on the number of rows, so a
batched greedy output may differ from the solo one at near-ties. Prefill chunking (and ``native_prefill``)
is part of a request's arithmetic: :meth:`Engine.generate` prefills natively in ``native_prefill_rows`` chunks
(Python whole prompts without a native decoder); other settings can differ from it at near-ties.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .budget import STEP_ROWS_MAX, NodeStats, RowBudget, measured_latency, measured_step_rows, step_rows_from_latency
from .drafters.steps import Steps, drive_together, propose_steps
from .grammar import constrain_, prune
from .interfaces import DraftContext, Drafter, GenerationError, request_drafter
from .logprobs import Committed, token_logprobs
from .penalties import PenaltyState, penalize_
from .prefix_cache import PrefixCache
from .step_costs import StepCosts, learner_of, step_costs_of
from .tree import TokenTree, TreeError, full_attention_mask
from .verify import accept, coupling_seed, sample_token, uses_coupling

if TYPE_CHECKING:
    from .engine import Engine, GenerationConfig, GenerationStats

# Drafting that keeps failing pauses (session 24): after BACKOFF_AFTER drafted steps in a row that accepted no
# draft token, a request decodes plainly for BACKOFF_START steps, then drafts once; each further failed probe
# doubles the pause (up to BACKOFF_MAX), and any accepted token ends it. Where drafts are rarely accepted (a strong
# repetition penalty, say) drafting only costs. Measured with the default drafter (benchmarks/backoff_ab.py, 10
# MT-Bench first turns x 128, on and off alternating per prompt): repetition 1.3: 0.977x plain against 0.927x; no
# penalty: 1.374x against 1.367x (it rarely triggers there). 8 / 8 / 64 paused normal text too often (1.320x
# against 1.388x on the same prompts).
BACKOFF_AFTER = 12
BACKOFF_START = 4
BACKOFF_MAX = 32
# Drafting that pays less than plain decoding pauses too (session 43, the rate guard): a request that steps alone on a
# learned curve (step_costs.py: its one-row anchor is what a run of plain steps costs here) adds up each drafted step's
# tokens and seconds (drafting, forward, acceptance); every GUARD_STEPS such steps, if they made fewer tokens per
# second than plain steps would have, it decodes plainly for its guard pause (GUARD_PAUSE_START steps, doubled on
# each further verdict against drafting, up to GUARD_PAUSE_MAX; a verdict for drafting resets it). On session 43's
# Xeon, where a tree row costs a quarter of a one-row step and drafting a few tenths of a millisecond, the default
# drafter's steps on first turns made 0.9x plain's tokens per second. TREEDRAFT_RATE_GUARD=0 turns it off.
GUARD_STEPS = 16
GUARD_PAUSE_START = 8
GUARD_PAUSE_MAX = 64
GUARD_CAP = 4.0  # a drafted step's forward counts as at most this many one-row forwards per row (a preempted one)
LOOP_ALPHA = 0.1  # weight of a step in the loop's per-step time (Scheduler._loop)
LOOP_GAP_MAX = 0.01  # a gap between two steps longer than this is idle time (between requests), not the loop's


def rate_guard_enabled() -> bool:
    """False when ``TREEDRAFT_RATE_GUARD`` is 0/false/no/off."""
    return os.environ.get("TREEDRAFT_RATE_GUARD", "1").strip().lower() not in {"0", "false", "no", "off"}


@dataclass(eq=False)
class Request:
    """One active request in the loop (created by :meth:`Scheduler.add`)."""

    prompt: list[int]
    config: GenerationConfig
    drafter: Drafter | None
    stats: GenerationStats
    cache: Any  # this request's own Cache (KVCache for the own runtime)
    gen: torch.Generator  # seeded from config.sampling.seed; only this request draws from it
    max_new: int  # token budget (max_new_tokens capped by the context left)
    tag: Any = None  # the caller's handle (e.g. the server's Job)
    tokens: list[int] = field(default_factory=list)  # prompt + committed tokens + the current root
    prefilled: int = 0  # prompt tokens already in the cache
    n_out: int = 0  # new tokens committed (the root included)
    last_hidden: Tensor | None = None  # (H,) target hidden state at the position that produced the root
    # (n_i, H) hidden states of the positions committed since the last propose (prompt chunks, accepted paths),
    # concatenated into DraftContext.accepted_hidden at the next propose (EAGLE extends its own cache with
    # them); kept only for a request with a drafter (plain decoding would grow it, and copy it, every step)
    path_hidden: list[Tensor] = field(default_factory=list)
    keep_hidden: bool = False  # keep path_hidden without a drafter too (self-distillation data reads it)
    error: BaseException | None = None  # set when this request failed (its drafter, say); it then leaves
    t_start: float = 0.0
    node_stats: NodeStats = field(default_factory=NodeStats)  # its drafts' acceptance by node position
    first_logits: Tensor | None = None  # (V,) its whole prompt came from the prefix cache: draw the first token
    penalty: PenaltyState | None = None  # the request's penalties are on: what they depend on
    prompt_hidden: list[Tensor] | None = None  # (n_i, H) prompt chunks' hidden states, for the prefix cache
    scope: str = ""  # whose prefix-cache entries it may reuse (the server's tenant)
    idle_streak: int = 0  # drafted steps in a row that accepted no draft token
    pause: int = 0  # steps left to decode plainly (drafting stopped paying; BACKOFF_*)
    backoff: int = BACKOFF_START  # the next pause's length
    guard: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # drafted solo steps: [steps, tokens, seconds]
    guard_pause: int = GUARD_PAUSE_START  # the rate guard's next pause
    gstate: tuple | None = None  # JSON mode (config.grammar): the automaton's state after the committed tokens
    # the key of its coupled draws (verify.accept_coupled): the seed, or for an unseeded sampled request one drawn
    # once from its generator (each position's uniform is still fresh, so its draws are exact samples), so that a
    # drafter told it (DraftContext.coupling) can draft the target's own draws; None for greedy requests
    coupling: int | None = None

    @property
    def done(self) -> bool:
        """Token budget reached, or failed."""
        return self.error is not None or (self.prefilled == len(self.prompt) and self.n_out >= self.max_new)

    prefilling = property(lambda self: self.prefilled < len(self.prompt))

    @property
    def pinned(self) -> bool:
        """Seeded sampling whose draws depend on the tree (typical acceptance): its tree size must not depend on
        the batch. The coupled lossless rule's tokens do not depend on the tree (verify.accept_coupled)."""
        s = self.config.sampling
        return not s.greedy and s.seed is not None and not uses_coupling(self.config.rule, s)

    def add_hidden(self, h: Tensor | None) -> None:
        """Append (n, H) hidden states of newly committed positions to those the next propose will see."""
        if h is not None and (self.drafter is not None or self.keep_hidden):
            self.path_hidden.append(h)

    def take_hidden(self) -> Tensor | None:
        """(n, H) hidden states committed since the last propose (None: none kept), and forget them."""
        parts, self.path_hidden = self.path_hidden, []
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def output(self) -> list[int]:
        """The new tokens delivered so far (``stats.new_tokens`` of them: cut by the text layer at EOS/stop)."""
        n = len(self.prompt)
        return self.tokens[n : n + self.stats.new_tokens]


@dataclass
class _Rows:
    """What one request contributes to a step's forward."""

    req: Request
    tokens: list[int]
    positions: list[int]  # (rows,) rotary positions (one tensor is built for the whole step)
    start: int
    mask: Tensor | None  # (rows, start + rows) or None = causal
    tree: TokenTree | None  # None: a prefill chunk
    logit_rows: list[int]  # rows of this block that need logits
    t_draft: float = 0.0
    states: list | None = None  # JSON mode: each tree row's automaton state (after the committed tokens and its path)
    drafted: bool = False  # its drafter proposed draft tokens (JSON mode may have pruned them all)
    forwards: int = 0  # draft-model forwards its drafter asked for this step (drafters.steps)
    observed: bool = False  # its drafter was asked, or a one-row exploration step: the learner takes its time
    asked: bool = False  # its drafter was asked (not a backoff pause, not an exploration step)


@dataclass
class StepTimes:
    """Where one :meth:`Scheduler.step` spent its time (seconds) and what it ran."""

    requests: int = 0  # requests with rows in the forward
    rows: int = 0  # rows of the forward (tree nodes + prefill rows)
    prefill_rows: int = 0
    committed: int = 0  # tokens committed by the step
    t_draft: float = 0.0  # drafters' propose + tree checks, masks, positions
    t_plan: float = 0.0  # the rest of planning (budgets, prefill chunks)
    t_forward: float = 0.0  # the target forward, packing and unpacking included
    t_commit: float = 0.0  # acceptance, sampling, cache compaction, bookkeeping


class Scheduler:
    """Active requests of one engine and the step that advances all of them by one target forward.

    step_rows: rows per step shared by the decoding requests' trees (None: each request's own
        ``max_tree_nodes``); a request's share is ``max(1, step_rows // decoding requests)``.
    prefill_chunk: prompt rows per step for joining requests (None: a whole prompt in one forward);
        a request's chunks always start at multiples of ``chunk_rows``, whatever else runs in the step:
        ``prefill_chunk``, or with ``native_prefill`` on a model with a native decoder (``native_prefill_rows``)
        at most the rows it runs, so prompts are prefilled natively (several requests' chunks per step, up to
        ``prefill_chunk``; faster than the Python path, and what :meth:`Engine.generate` runs, so with
        ``prefill_chunk >= native_prefill_rows`` greedy text equals the CLI's).
    prefix_cache_bytes: keep finished prompt prefills up to this many bytes (:mod:`treedraft.prefix_cache`; 0: off):
        a joining request whose prompt, or a chunk-aligned prefix of it, is cached (in its ``scope``) skips those
        rows of its prefill and keeps its solo tokens.
    latency: the forward's latency curve (rows -> seconds, :func:`measured_latency`): with two or more
        decoding requests their tree sizes come from :class:`treedraft.budget.RowBudget` (the nodes whose
        expected acceptance pays for their rows) instead of equal shares; ``step_rows`` then caps one
        request's tree (a lone request keeps ``step_rows``).
    """

    def __init__(
        self,
        engine: Engine,
        step_rows: int | None = None,
        prefill_chunk: int | None = None,
        latency: dict[int, float] | None = None,
        native_prefill: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> None:
        if step_rows is not None and step_rows < 1:
            raise ValueError(f"step_rows must be >= 1, got {step_rows}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.engine = engine
        self.step_rows, self.prefill_chunk = step_rows, prefill_chunk
        # chunked prefill through the native decoder (a prompt's first chunk too): chunks of at most the rows it
        # takes; the chunking is the model's and prefill_chunk's, never the batch's, so alone == batched
        native = getattr(engine.model, "native_prefill_rows", None)
        rows = native() if native_prefill and prefill_chunk is not None and callable(native) else None
        self.native_prefill = rows is not None
        self.chunk_rows = prefill_chunk if rows is None else min(prefill_chunk, rows)
        self.budget = RowBudget(latency) if latency else None
        # a native prefill is row-invariant (a row's bits do not depend on its chunk): any shared prefix is reusable
        align = 1 if self.native_prefill else self.chunk_rows
        self.prefix_cache = PrefixCache(prefix_cache_bytes, align) if prefix_cache_bytes > 0 else None
        self._sized = False
        self._prev: tuple[float, int, float] | None = None  # (start, rows, drafting s) of the last sized step
        # this step's learner of the forward's cost in decoding (step_costs.py): set when one drafting request's
        # tree is verified alone
        self._learn: StepCosts | None = None
        self.rate_guard = rate_guard_enabled()  # GUARD_*: pause drafting that trails plain decoding's rate
        self._te: float | None = None  # when the last step ended
        self._loop = 0.0  # seconds a step spends outside drafting, forward and acceptance (decayed mean)
        self.active: list[Request] = []
        self._torch_threads: int | None = host_torch_threads(engine.model)
        self.last_step = StepTimes()  # timings of the latest step (benchmarks, metrics)
        # called once per step after planning and drafting, just before the forward (which runs without the GIL):
        # the server hands the previous step's tokens to its event loop there (see server/worker.py)
        self.before_forward: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self.active)

    def add(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        drafter: Drafter | None | str = "default",
        stats: GenerationStats | None = None,
        cache: Any = None,
        tag: Any = None,
        scope: str = "",
    ) -> Request:
        """Admit a request (it joins at the next step); GenerationError for a prompt that cannot be served."""
        from .engine import GenerationConfig, GenerationStats

        eng = self.engine
        cfg = config or GenerationConfig()
        eng.check_prompt(prompt_ids)
        prompt = [int(t) for t in prompt_ids]
        if cfg.prediction and max(cfg.prediction) >= eng.model.vocab_size:
            raise GenerationError(
                f"prediction holds token id {max(cfg.prediction)}, outside this model's vocabulary of "
                f"{eng.model.vocab_size}"
            )
        max_new = eng.token_budget(len(prompt), cfg)
        if cache is None:  # room for the prompt, the budget and the widest tree at the last step
            model = eng.model
            cache = model.new_cache(min(model.max_seq_len, len(prompt) + max_new + cfg.max_tree_nodes))
        cache.length = 0
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        d = request_drafter(eng.drafter if drafter == "default" else drafter)
        req = Request(prompt, cfg, d, stats, cache, cfg.sampling.generator(), max_new, tag, tokens=list(prompt))
        if not cfg.sampling.greedy:
            req.coupling = coupling_seed(cfg.sampling, req.gen)
        req.scope = scope
        if cfg.penalties.active:
            req.penalty = PenaltyState(cfg.penalties, prompt)
        if cfg.grammar is not None:
            if cfg.grammar.vocab_size != eng.model.vocab_size:
                raise GenerationError(
                    f"the answer's grammar covers {cfg.grammar.vocab_size} token ids but the model has "
                    f"{eng.model.vocab_size}; build it with JsonGrammar.from_tokenizer(tokenizer, model.vocab_size)"
                )
            req.gstate = cfg.grammar.start()
        if self.prefix_cache is not None and getattr(cache, "kv", None) is not None:
            self._reuse_prefix(req)
        self.active.append(req)
        return req

    def _prefix_scope(self, req: Request) -> str:
        """The prefix cache's scope of ``req``: its tenant, and the model's attention-score arithmetic (a prefill
        computed with float32 scores is not what a bf16-score model would compute, so a model switched with
        ``model.bf16_scores = ...`` never reuses the other mode's entries)."""
        return req.scope + ("\x00bf16-scores" if getattr(self.engine.model, "bf16_scores", False) else "")

    def _reuse_prefix(self, req: Request) -> None:
        """Start ``req`` from the prefix cache's longest reusable prefix of its prompt (or record its prefill)."""
        req.prompt_hidden = []
        hit = self.prefix_cache.lookup(req.prompt, req.drafter is not None, self._prefix_scope(req))
        if hit is None:
            return
        e, n = hit.entry, hit.n
        req.cache.kv[:, :, :, :n] = e.kv[:, :, :, :n]
        req.cache.length = req.prefilled = n
        req.prompt_hidden.append(None if e.hidden is None else e.hidden[:n])
        req.add_hidden(None if e.hidden is None else e.hidden[:n])
        if n == len(req.prompt):
            req.first_logits = e.logits
            req.last_hidden = None if e.hidden is None else e.hidden[-1]
            req.prompt_hidden = None  # already cached

    def remove(self, req: Request) -> None:
        """Take a request out (finished, failed or cancelled); a drafter with ``finish`` gets its delivered tokens."""
        if req in self.active:
            self.active.remove(req)
            if req.n_out:
                self.engine._finish(req.drafter, req.prompt, req.output())

    # -- one step

    def _tree_budget(self, req: Request, share: int) -> int:
        """Tree size for this step: its ``max_tree_nodes``, the batch's share, the context left.

        A seeded request under typical acceptance is not shrunk (its draws depend on its trees, so its text
        would change with the batch): it gets its ``max_tree_nodes`` alone or batched (:attr:`Request.pinned`).
        """
        cap = req.config.max_tree_nodes
        if self.step_rows is not None and not req.pinned:
            cap = min(cap, share)
        return min(cap, self.engine.model.max_seq_len - req.cache.length)

    def _draft_steps(self, req: Request, budget: int, step: tuple[int, float, float]) -> Steps:
        """This request's rows of the step: its drafter's tree of at most ``budget`` nodes (``step``: the rest of a
        batched step, see :class:`DraftContext`'s ``step_*``), as steps: a drafter running a draft model yields its
        forwards (:mod:`.drafters.steps`), so :meth:`_plan` runs the forwards of all requests drafting with one draft
        model as one packed forward."""
        eng, ts = self.engine, time.perf_counter()
        max_depth = req.max_new - req.n_out - 1  # the bonus token takes one slot of the budget
        root = req.tokens[-1]
        paused = req.pause > 0
        req.pause -= paused
        # a one-row step now and then, so the learner knows what the root alone costs here (step_costs.py)
        explore = self._learn is not None and not req.pinned and self._learn.explore_due()
        asked = req.drafter is not None and budget > 1 and max_depth > 0 and not paused and not explore
        if asked:
            s = req.config.sampling
            ctx = DraftContext(
                req.tokens,
                req.last_hidden,
                budget,
                max_depth,
                len(req.prompt),
                req.take_hidden(),
                *step,
                req.penalty,
                req.config.prediction,
                s,
                req.coupling if uses_coupling(req.config.rule, s) else None,
                req.cache,
            )
            name = getattr(req.drafter, "name", type(req.drafter).__name__)
            try:
                tree = yield from propose_steps(req.drafter, ctx)
            except TreeError as e:
                raise TreeError(f"drafter {name!r} built a malformed tree: {e}") from e
            eng._check_tree(tree, root, eng.model.vocab_size, name)
            tree = tree.pruned_depth(max_depth)
        else:
            tree = TokenTree((root,), (-1,))
        states, drafted = None, len(tree) > 1
        if req.gstate is not None:  # JSON mode: the drafts it refuses would never be accepted; they cost no rows
            tree, states = prune(req.config.grammar, tree, req.gstate)
        tree = tree.truncated(budget)
        start, dev, n = req.cache.length, eng.device, len(tree)
        mask = None if n == 1 else full_attention_mask(tree, start, dev)
        pos = [start] if n == 1 else [start + d for d in tree.depths()]
        rows = _Rows(req, list(tree.tokens), pos, start, mask, tree, list(range(n)))
        rows.states = None if states is None else states[:n]
        rows.drafted = drafted
        rows.asked = asked
        rows.observed = asked or explore  # a step of the drafting regime (not a backoff pause): the learner's
        rows.t_draft = time.perf_counter() - ts
        return rows

    def _chunk(self, req: Request, rows: int) -> _Rows:
        a, b = req.prefilled, req.prefilled + rows
        last = [rows - 1] if b == len(req.prompt) else []
        return _Rows(req, req.prompt[a:b], list(range(a, b)), a, None, None, last)

    def _plan(self) -> list[_Rows]:
        """What each active request runs this step (a request failing to draft gets its error, no rows)."""
        chunks: list[_Rows] = []
        left = self.prefill_chunk  # prefill rows this step (None: whole prompts)
        for req in (r for r in self.active if r.prefilling and not r.done):
            rest = len(req.prompt) - req.prefilled
            n = rest if self.chunk_rows is None else min(self.chunk_rows, rest)
            if left is not None and n > left:
                break  # FIFO: the next joining request waits for the next step
            chunks.append(self._chunk(req, n))
            left = None if left is None else left - n
        decoding = [r for r in self.active if not r.prefilling and not r.done and r.first_logits is None]
        prefill_rows = sum(len(c.tokens) for c in chunks)
        budgets = self._budgets(decoding, prefill_rows)
        self._learn = None
        solo = decoding[0] if len(decoding) == 1 and not chunks else None  # one request's tree alone
        if solo is not None and solo.gstate is None and solo.penalty is None and solo.config.logprobs is None:
            # (None for plain decoding and drafters not sized on the learner; one turned off neither explores nor learns)
            self._learn = learner_of(solo.drafter)
        total = prefill_rows + sum(budgets)
        fixed = self.budget.overhead if self._sized and self.budget is not None else 0.0
        plan: list[_Rows] = []
        steps = [
            # the rest of a batched step: other rows, one token per other decoding request at least (not told to a pinned
            # request: its tree, and so its seeded typical text, must not depend on the batch; Request.pinned)
            self._draft_steps(
                req,
                b,
                (total - b, float(len(decoding) - 1), fixed) if len(decoding) > 1 and not req.pinned else (0, 0.0, 0.0),
            )
            for req, b in zip(decoding, budgets)
        ]
        ts = time.perf_counter()
        # side by side: the requests' draft-model forwards at each depth run as one packed forward per draft model
        rounds: list[float] = []  # seconds of each round of packed draft forwards
        forwards = [0] * len(steps)
        drafted = drive_together(steps, rounds, forwards)
        spent = time.perf_counter() - ts
        for req, (rows, error), f in zip(decoding, drafted, forwards):
            if error is not None:  # this request's drafter failed: it alone leaves
                req.error = error
                continue
            rows.forwards = f
            plan.append(rows)
        if len(decoding) > 1:  # they ran interleaved: the drafting time is split among the requests that drafted
            n = sum(r.drafted for r in plan)
            for r in plan:  # (where none drafted, the little time it took is split evenly)
                r.t_draft = (spent / n if r.drafted else 0.0) if n else spent / len(plan)
            if self._sized and self.budget is not None:
                self.budget.observe_drafting(n, spent, len(rounds), sum(rounds))
        return plan + chunks

    def _budgets(self, decoding: list[Request], prefill_rows: int) -> list[int]:
        """Tree size (root included) per decoding request: equal shares, or the row budget's choice."""
        self._sized = self.budget is not None and len(decoding) >= 2  # this step's trees come from the budget
        if self.budget is None or len(decoding) < 2:
            share = max(1, (self.step_rows or 1) // max(1, len(decoding)))
            return [self._tree_budget(r, share) for r in decoding]
        sizes = [self._tree_budget(r, self.step_rows or STEP_ROWS_MAX) for r in decoding]
        free = [i for i, r in enumerate(decoding) if not r.pinned and r.drafter is not None]
        others = [i for i in range(len(decoding)) if i not in free]  # pinned trees, plain requests
        fixed = prefill_rows + sum(1 if decoding[i].drafter is None else sizes[i] for i in others)
        stats = [decoding[i].node_stats for i in free]
        chosen = self.budget.allocate(stats, [sizes[i] for i in free], fixed, len(others))
        for i, s in zip(free, chosen):
            sizes[i] = s
        return sizes

    def _forward(self, plan: list[_Rows]) -> list[tuple[Tensor, Tensor | None]]:
        """Per request (logits (len(logit_rows), V), hidden (rows, H) or None), from one packed forward."""
        model, dev = self.engine.model, self.engine.device
        packed = getattr(model, "forward_packed", None)
        if packed is None:  # HF adapter, callable target: one forward per request, same step
            out = []
            for p in plan:
                lf = None if p.tree is not None else slice(-1, None)  # a prefill chunk: its last row only
                lg, h = model.forward(
                    torch.tensor([p.tokens], device=dev),
                    torch.tensor(p.positions, device=dev),
                    p.req.cache,
                    p.start,
                    p.mask,
                    lf,
                )
                out.append((lg[0], None if h is None else h[0]))
            return out
        from .models.llama import Segment

        segs = [Segment(p.req.cache, p.start, len(p.tokens), p.mask) for p in plan]
        offsets, r0, want = [], 0, []
        for p in plan:
            offsets.append(r0)
            want += [r0 + i for i in p.logit_rows]
            r0 += len(p.tokens)
        toks = torch.tensor([t for p in plan for t in p.tokens], device=dev)
        pos = torch.tensor([x for p in plan for x in p.positions], device=dev)
        kw = {"native_prefill": True} if self.native_prefill else {}
        logits, hidden = packed(toks, pos, segs, torch.tensor(want, dtype=torch.long, device=dev), **kw)
        out, li = [], 0
        for p, o in zip(plan, offsets):
            k = len(p.logit_rows)
            out.append((logits[li : li + k], hidden[o : o + len(p.tokens)]))
            li += k
        return out

    def step(self) -> list[tuple[Request, list[int]]]:
        """Advance every active request by one target forward; (request, tokens it committed) for each.

        A request that finished its prefill gets its first token; a decoding one its accepted drafts + bonus.
        A request whose drafting or acceptance failed is returned with ``error`` set (and no tokens);
        the caller removes it. An error in the forward itself fails the whole step (raised).
        """
        from .kernels import torch_threads

        with torch_threads(self._torch_threads):
            return self._step()

    def _step(self) -> list[tuple[Request, list[int]]]:
        t0 = time.perf_counter()
        if self._prev is not None and self.budget is not None:  # the last sized step's whole period
            start, rows, drafting = self._prev
            self.budget.observe_step(rows, t0 - start - drafting)
        self._prev = None
        plan = self._plan()
        failed = [(r, []) for r in self.active if r.error is not None]
        firsts = []
        for r in [r for r in self.active if r.first_logits is not None]:
            try:
                firsts.append((r, self._first(r, r.first_logits, r.last_hidden)))
            except Exception as e:  # e.g. JSON mode with no allowed token: this request alone fails
                r.error = e
                failed.append((r, []))
            r.first_logits = None
        if not plan:
            self.last_step = StepTimes(committed=len(firsts))
            return failed + firsts
        if self.before_forward is not None:
            self.before_forward()
        tv = time.perf_counter()
        results = self._forward(plan)
        tr = time.perf_counter()
        out: list[tuple[Request, list[int]]] = []
        for p, (logits, hidden) in zip(plan, results):
            try:
                new = self._commit(p, logits, hidden, tv, tr)
            except Exception as e:  # e.g. a drafter's inconsistent q in the acceptance rule
                p.req.error = e
                new = []
            if new or p.req.error is not None:
                out.append((p.req, new))
        te = time.perf_counter()
        t_draft = sum(p.t_draft for p in plan)
        rows = sum(len(p.tokens) for p in plan)
        if self._te is not None and t0 - self._te < LOOP_GAP_MAX:  # the step's Python outside drafting and forward
            self._loop += LOOP_ALPHA * (t0 - self._te + tv - t0 - t_draft - self._loop)
        self._te = te
        if self._learn is not None and len(plan) == 1 and plan[0].observed:  # (the forward and the acceptance)
            self._learn.observe(len(plan[0].tokens), plan[0].start, te - tv)
            if plan[0].asked and out and self.rate_guard:
                self._guard(plan[0], len(out[-1][1]), te - tv)
        else:  # what this forward was (rows), so the learner knows what its next step comes after
            seen = step_costs_of(self.engine.model)
            if seen is not None:
                seen.saw(rows)
        if self._sized:
            self._prev = (t0, rows, t_draft)
        self.last_step = StepTimes(
            len(plan),
            rows,
            sum(len(p.tokens) for p in plan if p.tree is None),
            sum(len(n) for _, n in out),
            t_draft,
            tv - t0 - t_draft,
            tr - tv,
            te - tr,
        )
        return failed + firsts + out

    def _first(self, req: Request, logits: Tensor, hidden: Tensor | None) -> Committed:
        """Draw the first token from the prompt's last logits row (V,); ``hidden``: that position's (H,) state."""
        cfg = req.config
        undo = self._constrain(req, logits[None], [()], None if req.gstate is None else [req.gstate])
        try:
            root = sample_token(cfg.rule, logits, cfg.sampling, req.gen, len(req.tokens), req.coupling)
        finally:
            undo()  # the model's own row again: the prefix cache may hold it; logprobs report it
        if req.penalty is not None:
            req.penalty.add([root])
        if req.gstate is not None:
            req.gstate = self._advance(req, req.gstate, [root])
        req.last_hidden = hidden
        req.tokens.append(root)
        req.n_out = 1
        req.t_start = time.perf_counter()
        req.stats.new_tokens, req.stats.t_decode = 1, time.perf_counter() - req.t_start
        lps = None if cfg.logprobs is None else token_logprobs(logits[None], [root], cfg.logprobs)
        return Committed.of([root], lps)

    def _commit(self, p: _Rows, logits: Tensor, hidden: Tensor | None, tv: float, tr: float) -> list[int]:
        req, cfg = p.req, p.req.config
        if p.tree is None:  # a prefill chunk
            req.cache.keep(p.start, range(len(p.tokens)))
            req.prefilled += len(p.tokens)
            req.add_hidden(hidden)
            req.stats.t_prefill += tr - tv
            if req.prompt_hidden is not None:  # recorded for the prefix cache
                req.prompt_hidden.append(hidden)
            if req.prefilling:
                return []
            if req.prompt_hidden is not None:
                hs = None if any(h is None for h in req.prompt_hidden) else torch.cat(req.prompt_hidden)
                kv = req.cache.kv[:, :, :, : len(req.prompt)]
                self.prefix_cache.store(req.prompt, kv, hs, logits[-1], self._prefix_scope(req))
                req.prompt_hidden = None
            return self._first(req, logits[-1], None if hidden is None else hidden[-1])
        tree, n = p.tree, len(p.tree)
        paths = None
        if req.penalty is not None:  # each row as plain decoding would adjust it (its path's tokens counted)
            paths = [[tree.tokens[k] for k in tree.path_to(i)[1:]] for i in range(n)]
        undo = self._constrain(req, logits, paths, p.states)
        try:
            if n == 1:
                acc_nodes, bonus = (
                    (0,),
                    sample_token(cfg.rule, logits[0], cfg.sampling, req.gen, len(req.tokens), req.coupling),
                )
            else:
                a = accept(cfg.rule, tree, logits, cfg.sampling, req.gen, len(req.tokens), req.coupling)
                acc_nodes, bonus = a.nodes, a.bonus
        finally:
            undo()
        req.cache.keep(p.start, list(acc_nodes))
        if self.budget is not None:
            self.budget.observe(req.node_stats, n, acc_nodes, p.t_draft, self._sized, p.forwards)
        if hidden is not None:
            req.last_hidden = hidden[acc_nodes[-1]]
            if req.drafter is not None or req.keep_hidden:  # (a root-only step: a view, no gather)
                req.add_hidden(hidden[:1] if n == 1 else hidden[list(acc_nodes)])
        else:
            req.last_hidden = None
        new = [tree.tokens[i] for i in acc_nodes[1:]] + [bonus]  # accepted drafts + the next root
        req.tokens.extend(new)
        if req.penalty is not None:
            req.penalty.add(new)
        if p.states is not None:  # the accepted path's state, then the bonus token
            req.gstate = self._advance(req, p.states[acc_nodes[-1]], [bonus])
        if p.drafted:  # drafts the automaton refused all count as a failed drafted step (backoff)
            self._track_drafting(req, accepted=len(new) > 1)
        te = time.perf_counter()
        depth = 0 if n == 1 else max(tree.depths())
        from .engine import StepStats

        req.stats.steps.append(StepStats(n, depth, len(new) - 1, p.t_draft, tr - tv, te - tr))
        req.n_out += len(new)
        req.stats.new_tokens, req.stats.t_decode = req.n_out, time.perf_counter() - req.t_start
        if cfg.logprobs is None:
            return new
        # token new[i] was predicted by the row of accepted node i (the bonus by the last one's)
        return Committed.of(new, token_logprobs(logits[list(acc_nodes)], new, cfg.logprobs))

    @staticmethod
    def _constrain(req: Request, logits: Tensor, paths: list | None, states: list | None) -> Callable[[], None]:
        """Adjust a step's rows in place as plain decoding would (penalties with each row's ``paths``, then JSON
        mode's ``states``); returns the undo."""
        undos = []
        if req.penalty is not None:
            undos.append(penalize_(logits, req.penalty, paths))
        if states is not None:
            try:
                undos.append(constrain_(logits, req.config.grammar, states, req.config.sampling.greedy))
            except BaseException:
                for u in undos:  # the rows may be the prefix cache's: never leave them adjusted
                    u()
                raise

        def undo() -> None:
            for u in reversed(undos):
                u()

        return undo

    @staticmethod
    def _advance(req: Request, state: tuple, tokens: list[int]) -> tuple:
        for t in tokens:
            state = req.config.grammar.advance(state, t)
            if state is None:  # the rows were constrained: only a broken mask gets here
                raise GenerationError(f"constrained answer: token {t} was chosen where the grammar cannot take it")
        return state

    def _guard(self, p: _Rows, tokens: int, seconds: float) -> None:
        """The rate guard (GUARD_*): a drafted solo step of ``p``'s request made ``tokens`` with its forward and
        acceptance taking ``seconds`` (its drafting: ``p.t_draft``)."""
        req, learn = p.req, self._learn
        anchor = None if learn is None else learn.one_row_seconds(p.start)
        if anchor is None or req.pinned:  # no anchor yet; a pinned request's trees must not depend on timings
            return
        # both sides with the loop's own per-step time (planning, streaming: a plain token pays it per token); a
        # preempted forward counts as GUARD_CAP one-row forwards a row at most
        seconds = p.t_draft + min(seconds, GUARD_CAP * anchor * len(p.tokens)) + self._loop
        plain = anchor + self._loop
        g = req.guard
        g[0], g[1], g[2] = g[0] + 1, g[1] + tokens, g[2] + seconds
        if g[0] < GUARD_STEPS:
            return
        if g[1] * plain < g[2]:  # fewer tokens per second than plain steps: pause drafting
            req.pause = max(req.pause, req.guard_pause)
            req.guard_pause = min(2 * req.guard_pause, GUARD_PAUSE_MAX)
        else:
            req.guard_pause = GUARD_PAUSE_START
        g[0] = g[1] = g[2] = 0.0

    @staticmethod
    def _track_drafting(req: Request, accepted: bool) -> None:
        """After a drafted step: an accepted token ends any backoff; BACKOFF_AFTER failures in a row pause drafting
        (a failed probe after a pause pauses again, twice as long)."""
        if accepted:
            req.idle_streak, req.backoff = 0, BACKOFF_START
            return
        req.idle_streak += 1
        if req.idle_streak >= BACKOFF_AFTER:
            req.pause, req.backoff = req.backoff, min(2 * req.backoff, BACKOFF_MAX)
            req.idle_streak = BACKOFF_AFTER - 1  # the probe after the pause decides alone


def host_torch_threads(model: Any) -> int | None:
    """Torch threads for a step's Python-side ops: 1 when the native fused decoder runs the forwards, else None.

    The native pool then does the heavy work; one torch thread keeps idle OpenMP threads from spinning on
    the cores it (or another process) needs (see :func:`treedraft.kernels.torch_threads`).
    """
    if not hasattr(model, "forward_packed") or not hasattr(model, "layers"):
        return None
    from .models import fused

    try:
        return 1 if fused.decoder_for(model) is not None else None
    except (AttributeError, TypeError):  # not the own Llama module
        return None


def run_alone(
    engine: Engine, prompt_ids: Sequence[int], config: GenerationConfig | None = None, **kw: Any
) -> list[int]:
    """The tokens of one request run by a fresh scheduler on its own (the reference for batched runs)."""
    sched = Scheduler(
        engine,
        kw.pop("step_rows", None),
        kw.pop("prefill_chunk", None),
        kw.pop("latency", None),
        kw.pop("native_prefill", False),
    )
    req = sched.add(prompt_ids, config, **kw)
    while not req.done:
        sched.step()
    if req.error is not None:
        raise req.error
    sched.remove(req)
    return req.tokens[len(req.prompt) : len(req.prompt) + req.n_out]


__all__ = [
    "GenerationError",
    "Request",
    "Scheduler",
    "StepTimes",
    "measured_latency",
    "measured_step_rows",
    "run_alone",
    "step_rows_from_latency",
]
