"""Drafter over a plain callable ``draft(prefix) -> {token: prob}`` (model-agnostic mode).

The tree is grown level by level: every node of a level above ``len(branching)``
gets ``branching[depth]`` children, either the draft's top-k tokens
(deterministic) or tokens *sampled* from the draft distribution one after another
without replacement, in which case the distribution is recorded in
``TokenTree.child_q`` so the lossless rule stays exact. The draft calls of one level
run concurrently in a thread pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from ..interfaces import DraftContext
from ..models.callable_target import token_id
from ..tree import TokenTree

DraftFn = Callable[[list[int]], Mapping[int, float]]
MODES = ("topk", "sample")


class CallableDrafter:
    """Builds a draft tree from ``draft(prefix) -> {token: prob}``; never verifies."""

    def __init__(
        self,
        draft: DraftFn,
        vocab_size: int,
        branching: Sequence[int] = (3, 2, 1),
        mode: str = "topk",
        seed: int | None = None,
        max_workers: int = 8,
        name: str = "callable",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        if not branching or any(int(b) < 1 for b in branching):
            raise ValueError(f"branching needs one positive child count per depth, got {list(branching)}")
        if vocab_size < 1 or max_workers < 1:
            raise ValueError(f"need vocab_size >= 1 and max_workers >= 1, got {vocab_size}, {max_workers}")
        self.draft = draft
        self.vocab_size = vocab_size
        self.branching = tuple(int(b) for b in branching)
        self.mode = mode
        self.name = name
        self.max_workers = max_workers
        self.gen = torch.Generator()
        if seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(int(seed))
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Shut the worker threads down."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def distribution(self, prefix: list[int]) -> Tensor:
        """(V,) float64 draft distribution after ``prefix`` (one call of the draft callable, renormalised)."""
        dist = self.draft(list(prefix))
        if not isinstance(dist, Mapping):
            raise TypeError(
                f"draft callable of drafter {self.name!r} returned {type(dist).__name__}; "
                "expected a dict {token: prob}"
            )
        q = torch.zeros(self.vocab_size, dtype=torch.float64)
        for t, p in dist.items():
            t = token_id(t, f"draft callable of drafter {self.name!r}", self.vocab_size)
            if not float(p) >= 0.0:
                raise ValueError(f"draft callable of drafter {self.name!r} returned probability {p!r} for {t}")
            q[t] += float(p)
        s = float(q.sum())
        return q / s if s > 0 else q

    def _children(self, q: Tensor, k: int) -> list[int]:
        """Up to k tokens: top-k of q, or k draws from q without replacement (order = draw order)."""
        k = min(k, int((q > 0).sum()))
        if k == 0:
            return []
        if self.mode == "topk":
            return [int(t) for t in q.topk(k).indices.tolist()]
        out, rest = [], q.clone()
        for _ in range(k):  # one draw at a time: the order matters to the acceptance rule
            t = int(torch.multinomial(rest, 1, generator=self.gen))
            out.append(t)
            rest[t] = 0.0
        return out

    def propose(self, ctx: DraftContext) -> TokenTree:
        """Grow the tree breadth-first within ctx.max_nodes / ctx.max_depth."""
        tokens, parents = [ctx.root], [-1]
        child_q: dict[int, Tensor] = {}
        paths: dict[int, list[int]] = {0: []}  # node -> draft tokens below the root
        level = [0]
        max_depth = min(ctx.max_depth, len(self.branching))
        for depth in range(max_depth):
            if not level or len(tokens) >= ctx.max_nodes:
                break
            prefixes = [ctx.tokens + paths[n] for n in level]
            if len(prefixes) == 1:
                dists = [self.distribution(prefixes[0])]
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="treedraft-draft")
                dists = list(self._pool.map(self.distribution, prefixes))
            nxt = []
            for node, q in zip(level, dists):
                room = ctx.max_nodes - len(tokens)
                kids = self._children(q, min(self.branching[depth], room))
                if not kids:
                    continue
                if self.mode == "sample":
                    child_q[node] = q
                for t in kids:
                    paths[len(tokens)] = paths[node] + [t]
                    nxt.append(len(tokens))
                    tokens.append(t)
                    parents.append(node)
            level = nxt
        return TokenTree(tuple(tokens), tuple(parents), child_q)
