"""Suffix drafter: trees of frequent continuations from this request and from earlier outputs.

SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", NeurIPS 2025; in vLLM through Snowflake's Arctic Inference). Two suffix indexes answer
"what followed the last tokens before?": one over the current request (prompt + output so far,
extended every step) and one over earlier requests' outputs (a :class:`SuffixStore`, per tenant,
optionally persistent). Each step, in each index:

1. match: the longest suffix of the context (up to ``max_match`` tokens) that occurs there;
2. expand: a best-first tree of its continuations, a node's score being the empirical probability of
   its path (product of count(child) / count(parent)), nodes below ``min_prob`` dropped;
3. size (SuffixDecoding's adaptive rule): at most ``alpha * match length`` nodes, capped by the
   engine's node budget, ``max_spec_tokens`` and depth. A long match is a passage being repeated and
   earns a big tree; a one-token match earns a node or two.
4. with ``latency`` (the target's forward time by row count; the registry passes the measured curve):
   the tree is cut further to what pays for its rows (:mod:`.suffix_sizing`): each node's calibrated
   acceptance probability (empirical ratios times P(accepted | match length at that node), a prior
   updated by this request's outcomes) against the marginal cost of one more verify row. A request's own
   chain that runs into the end of the context continues periodically (a model repeating itself).
   The tree is expanded best-first by that calibrated value and stops at the first node that lowers the
   expected tokens per second (``priced``): the same tree as expanding ``alpha x match`` nodes and cutting
   afterwards, without building the nodes that are cut.

Per step, each index's match continues the previous step's where one of its occurrences goes on with
the tokens committed since (``follow``; :meth:`SuffixIndex.follow`), instead of seeding a new lookup: on a
second turn the chains run for dozens of steps. Both cut the member's draft time per step (the suffix
member drafted ~5x prompt lookup's per step on MT-Bench second turns, its whole loss to it;
benchmarks/suffix_profile.py, benchmarks/results/sfx7.md).

The tree with the higher score (the expected number of accepted tokens: under the empirical model, or
calibrated with ``latency``) is proposed, as in the paper. Trees are deterministic (no ``child_q``), so the hybrid drafter can merge
this one with Medusa / prompt-lookup trees and the greedy output equals plain decoding.

Recording: call :meth:`SuffixDrafter.finish` with a request's prompt and output when it ends. With
``auto_record`` (default), a request that was not finished that way is recorded when the next one
starts (or on :meth:`flush`), from the engine's token list: prompt tail + everything verified.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..interfaces import DraftContext
from ..tree import TokenTree
from .suffix_index import DraftPaths, SuffixIndex
from .suffix_sizing import (
    AcceptanceModel,
    LatencyCurve,
    RatePricer,
    best_prefix,
    calibrated_values,
    expansion_cap,
    keep_nodes,
    node_depths,
    periodic_extend,
)
from .suffix_store import DEFAULT_MAX_TOKENS, SuffixStore


@dataclass
class SuffixDrafter:
    store: SuffixStore | None = None  # earlier requests; None = this request only
    tenant: str = ""
    alpha: float = 1.0  # tree nodes per matched token (SuffixDecoding's max_spec_factor)
    max_spec_tokens: int = 32  # absolute cap on the tree size (root excluded)
    max_depth: int = 24
    min_prob: float = 0.1  # drop continuations rarer than this (empirical path probability)
    max_match: int = 64  # longest context suffix that is matched
    min_match: int = 1  # shorter matches draft nothing; >= 2 also makes a lookup cheap (see SuffixIndex.match)
    max_occurrences: int = 4096  # per lookup: at most this many (most recent) occurrences are narrowed
    expand_occurrences: int = 256  # per tree node: continuation counts from at most this many occurrences
    prompt_context: int | None = 32  # prompt tokens recorded ahead of the output (None = the whole prompt)
    use_local: bool = True
    auto_record: bool = True
    # forward seconds by rows (root included): size trees by expected accepted tokens per second
    # (suffix_sizing); None = the alpha rule alone
    latency: Mapping[int, float] | None = None
    periodic: bool = True  # with latency: a request's own chain reaching the context's end repeats (a loop)
    # with latency: expand best-first by calibrated value and stop where a row stops paying (suffix_sizing.
    # RatePricer), instead of expanding alpha x match nodes by empirical probability and cutting afterwards
    priced: bool = True
    follow: bool = True  # continue the last step's match where it goes on (SuffixIndex.follow), not re-match
    name: str = "suffix"
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel, init=False, repr=False)
    _curve: LatencyCurve | None = field(default=None, init=False, repr=False)
    _last: tuple[int, DraftPaths] | None = field(default=None, init=False, repr=False)  # (len(tokens), tree)
    _cur: list[int] | None = field(default=None, init=False, repr=False)  # the engine's token list
    _cur_prompt_len: int = field(default=0, init=False, repr=False)
    _cur_tenant: str = field(default="", init=False, repr=False)  # the tenant when the request began
    _local: SuffixIndex = field(default_factory=SuffixIndex, init=False, repr=False)
    _ref: SuffixIndex | None = field(default=None, init=False, repr=False)  # the request's predicted output
    # last step's match per index ("local", "store", "reference"): (index, its length, context length, m, nxt)
    _prev: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        for name in ("max_spec_tokens", "max_depth", "max_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.min_match <= self.max_match or self.max_occurrences < 1 or self.expand_occurrences < 1:
            raise ValueError(
                f"need 1 <= min_match <= max_match and max_occurrences, expand_occurrences >= 1; got min_match="
                f"{self.min_match}, max_match={self.max_match}, max_occurrences={self.max_occurrences}, "
                f"expand_occurrences={self.expand_occurrences}"
            )
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob}")
        self._curve = None if self.latency is None else LatencyCurve(self.latency)

    # ---- requests --------------------------------------------------------------
    def for_tenant(self, tenant: str) -> SuffixDrafter:
        """A drafter with the same store and settings for another tenant (its own request state)."""
        return dataclasses.replace(self, tenant=tenant)

    def fresh(self) -> SuffixDrafter:
        """The same settings with nothing learned: an empty in-memory store (same bound and sharing), no request.

        For measurements that must not depend on what earlier runs indexed (``treedraft bench
        --fresh-drafter-state``); a persistent store is left untouched.
        """
        if self.store is not None and self.store.path is not None:  # the user's --suffix-store: kept, as said
            return dataclasses.replace(self)
        store = None if self.store is None else SuffixStore(max_tokens=self.store.max_tokens, share=self.store.share)
        return dataclasses.replace(self, store=store)

    def for_request(self) -> SuffixDrafter:
        """A twin for one request (the scheduler's per-request drafter): same store, tenant and settings, its own
        request index and acceptance model."""
        return dataclasses.replace(self)

    def record_tokens(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
        """What is indexed for a finished request: the prompt's tail, then the output."""
        keep = len(prompt_ids) if self.prompt_context is None else min(len(prompt_ids), self.prompt_context)
        tail = list(prompt_ids)[len(prompt_ids) - keep :]
        return [int(t) for t in tail] + [int(t) for t in output_ids]

    def finish(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Record a finished request in the store, under the tenant it ran for (ends the request in progress)."""
        tenant = self._cur_tenant if self._cur is not None else self.tenant
        self._cur = None
        if self.store is not None and len(output_ids):
            self.store.add(self.record_tokens(prompt_ids, output_ids), tenant)

    def flush(self) -> None:
        """Record the request in progress, if any (auto_record), e.g. before shutting down."""
        cur = self._cur
        if cur is not None and self.auto_record and self.store is not None:
            self.finish(cur[: self._cur_prompt_len], cur[self._cur_prompt_len :])
        self._cur = None

    def _sync(self, ctx: DraftContext) -> None:
        """Point the request index at ctx.tokens, extending it with the tokens verified since last step."""
        toks = ctx.tokens
        if toks is not self._cur or len(toks) < len(self._local):
            self.flush()
            self._cur, self._cur_prompt_len, self._cur_tenant = toks, ctx.prompt_len, self.tenant
            self._local = SuffixIndex()
            self._ref = None
            if ctx.reference:  # a predicted output: an index of its own, matched like the store's
                self._ref = SuffixIndex()
                self._ref.extend([int(t) for t in ctx.reference], end=True)
            self._prev = {}
            self.acceptance.reset()  # outcomes are per request: no tenant's history shapes another's trees
            self._last = None
        elif self._last is not None:
            self._observe(toks)
        if self.use_local and len(toks) > len(self._local):
            self._local.extend(toks[len(self._local) :])

    # ---- drafting --------------------------------------------------------------
    def paths(
        self,
        index: SuffixIndex,
        context: Sequence[int],
        max_nodes: int,
        max_depth: int,
        local: bool = False,
        key: str = "store",
    ) -> DraftPaths:
        """Match ``context`` in ``index`` and expand a tree sized by the match length (and the latency curve).

        ``local``: ``index`` holds exactly ``context`` (the request's own index), so a chain may run on
        periodically past its end. ``key``: which index's last match a non-local lookup follows on from.
        """
        m, nxt = self._match(index, context, local, key)
        if m < self.min_match:
            return DraftPaths([], [], [], m)
        limit, depth = min(max_nodes, self.max_spec_tokens), min(max_depth, self.max_depth)
        if self._curve is None:
            size = min(limit, max(1, math.floor(self.alpha * m)))
            return index.expand(nxt, m, size, depth, self.min_prob, self.expand_occurrences)
        size = expansion_cap(m, self.alpha, limit)
        loops = local and self.periodic and nxt.size and len(index) == len(context)
        curve = self._curve.at(len(context))  # rows cost more on a longer cache (budget.ContextLatency)
        if self.priced:  # best-first by calibrated value, stopped where one more row stops paying
            pricer = RatePricer(curve, max_nodes=size)
            accept = self.acceptance.probs(m, min(size + 1, depth))  # accept[d - 1] = h(m + d - 1)
            priced = index.expand(nxt, m, size, depth, self.min_prob, self.expand_occurrences, accept, pricer.take)
            period = len(context) - int(nxt.max()) if loops else 0  # the chain reaches the end after this many
            if (
                not loops
                or len(priced.tokens) < period  # cannot hold the chain to the end: nothing to extend
                or min(depth, size) <= period
                or periodic_extend(priced, context, int(nxt.max()), min(depth, size)) is priced
            ):
                return keep_nodes(priced, range(pricer.best), priced.probs)
            # the chain runs into the end of the context (a loop): extended periodically, priced below
        raw = index.expand(nxt, m, size, depth, self.min_prob, self.expand_occurrences)
        if loops:
            raw = periodic_extend(raw, context, int(nxt.max()), min(depth, size))
        values = calibrated_values(raw, self.acceptance)
        keep, _ = best_prefix(values, curve, max_nodes=size)
        return keep_nodes(raw, keep, values)

    def _match(
        self, index: SuffixIndex, context: Sequence[int], local: bool, key: str = "store"
    ) -> tuple[int, np.ndarray]:
        """``index.match`` of ``context``, followed on from the last step's match where one of its occurrences
        goes on with the tokens committed since (:meth:`SuffixIndex.follow`: no new seeding, the same result
        while the index only grew by this request's tokens; a match reaching ``max_match`` is re-matched)."""
        key = "local" if local else key
        prev, got = self._prev.get(key), None
        if prev is not None and self.follow:
            idx, ilen, clen, m, nxt = prev
            k = len(context) - clen
            if idx is index and k > 0 and len(index) - ilen == (k if local else 0):
                got = index.follow(context[clen:], m, nxt, self.max_match)
        if got is None:
            got = index.match(context, self.max_match, self.min_match, self.max_occurrences)
        self._prev[key] = (index, len(index), len(context), *got) if got[0] >= self.min_match else None
        return got

    def _observe(self, toks: Sequence[int]) -> None:
        """Score the last proposed tree against what the target committed since: update h(match length)."""
        assert self._last is not None
        at, tree = self._last
        self._last = None
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            kids.setdefault(p, []).append(i)
        depth = node_depths(tree.parents)
        node = -1
        for t in toks[at:]:  # the accepted drafts, then the target's own token where the draft went wrong
            ch = kids.get(node)
            if not ch:
                return
            hit = next((i for i in ch if tree.tokens[i] == t), None)
            if hit is None:  # the most probable child was rejected (the others too)
                best = max(ch, key=lambda i: tree.probs[i])
                self.acceptance.observe(tree.match_len + depth[best] - 1, False)
                return
            self.acceptance.observe(tree.match_len + depth[hit] - 1, True)
            node = hit

    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree rooted at ctx.root: the better of the request's and the store's continuation trees."""
        return self.propose_scored(ctx)[0]

    def propose_scored(self, ctx: DraftContext) -> tuple[TokenTree, float]:
        """:meth:`propose`'s tree and its score: the expected number of accepted tokens under the empirical model.

        The hybrid drafter uses the score to decide whose branches come first under the node budget.
        """
        tree, values = self.propose_valued(ctx)
        return tree, float(sum(values))

    def propose_valued(self, ctx: DraftContext) -> tuple[TokenTree, list[float]]:
        """:meth:`propose`'s tree and each draft node's value (node i + 1's P(path accepted); calibrated with
        ``latency``, else the empirical path probability); their sum is :meth:`propose_scored`'s score.

        The hybrid drafter prices its paid members (Medusa heads) against these values.
        """
        self._sync(ctx)
        budget, depth = ctx.max_nodes - 1, ctx.max_depth
        best = DraftPaths([], [], [], 0)
        if budget >= 1 and depth >= 1:
            if self.use_local:
                best = self.paths(self._local, ctx.tokens, budget, depth, local=True)
            if self.store is not None:
                index = self.store.index_for(self._cur_tenant)
                with self.store.lock:  # another thread's add() may be growing this index
                    g = self.paths(index, ctx.tokens, budget, depth)
                if g.score > best.score:
                    best = g
            if self._ref is not None:
                g = self.paths(self._ref, ctx.tokens, budget, depth, key="reference")
                if g.score > best.score:
                    best = g
        self._last = (len(ctx.tokens), best) if self._curve is not None and best.tokens else None
        tree = TokenTree((int(ctx.root), *best.tokens), (-1, *(p + 1 for p in best.parents)))
        return tree, [float(v) for v in best.probs]


def tenant_id(api_key: str | None = None, user: str | None = None) -> str:
    """A tenant key for library use of the suffix drafter: a hash of the API key (never the key itself: it is written
    to disk), then ``user``. Requests with the same key and user share an index; a different key, or a different
    ``user`` under one key, gets its own. Without either, everyone is the anonymous tenant "".

    (The server keys tenants otherwise: ``server.auth.tenant_id``, the key's hash alone when keys are configured,
    else the request's ``user`` field.)
    """
    import hashlib

    key = "" if not api_key else "k:" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:24]
    return key + ("" if not user else f"/u:{user}")


def open_suffix_store(
    path: str | os.PathLike | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    share: bool = False,
    max_total_tokens: int | None = None,
) -> SuffixStore:
    """The store behind ``--suffix-store DIR --suffix-max-tokens N --suffix-share --suffix-max-total-tokens M`` (None =
    in memory; M None: 16 N); a ValueError naming the directory when it cannot be one (a file there, no permission), or
    what is wrong with the arguments."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"suffix_store must be a directory path (or None: in memory), got {path!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError(f"suffix_max_tokens must be an integer >= 1, got {max_tokens!r}")
    if max_total_tokens is not None and (isinstance(max_total_tokens, bool) or not isinstance(max_total_tokens, int)):
        raise ValueError(f"suffix_max_total_tokens must be an integer >= 1 or None, got {max_total_tokens!r}")
    if not isinstance(share, bool):
        raise ValueError(f"suffix_share must be True or False, got {share!r}")
    try:
        return SuffixStore(path, max_tokens=max_tokens, share=share, max_total_tokens=max_total_tokens)
    except OSError as e:
        raise ValueError(f"cannot keep the suffix store in {path} (--suffix-store / suffix_store=): {e}") from None


def make_suffix_drafter(store: SuffixStore | None = None, tenant: str = "", **options: object) -> SuffixDrafter:
    """Registry factory for ``suffix``: a drafter over ``store`` for ``tenant`` (options: SuffixDrafter fields)."""
    settable = {k for k, f in SuffixDrafter.__dataclass_fields__.items() if f.init} - {"store", "tenant"}
    bad = sorted(set(options) - settable)
    if bad:
        raise ValueError(f"unknown suffix drafter option(s) {bad}; choose from {sorted(settable)}")
    return SuffixDrafter(store if store is not None else SuffixStore(), tenant, **options)  # type: ignore[arg-type]
