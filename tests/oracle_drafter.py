"""A test drafter sized on a latency curve that drafts the next three tokens of a known greedy output (always
accepted): tests of the step-cost learner and the rate guard (tests/test_step_costs.py, tests/test_rate_guard.py)."""

from __future__ import annotations

from treedraft.budget import LatencyCurve
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree


class Oracle:
    """Drafts the next three tokens of a known greedy output (always accepted: no backoff pauses its drafting)."""

    name = "oracle"

    def __init__(self, latency, prompt: list[int], output: list[int]) -> None:
        self.curve, self.prompt, self.output = LatencyCurve(latency), prompt, output

    def propose(self, ctx: DraftContext) -> TokenTree:
        self.curve.at(len(ctx.tokens))  # a drafter sized on the curve
        k = len(ctx.tokens) - len(self.prompt)  # output tokens committed so far (the root is the last)
        nxt = self.output[k : k + min(3, ctx.max_nodes - 1, ctx.max_depth)]
        return TokenTree((ctx.root, *nxt), (-1, *range(len(nxt))))
