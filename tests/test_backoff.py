"""Drafting backoff (scheduler.BACKOFF_*): a request whose drafts keep failing decodes plainly for a while, probes,
and drafts every step again once a draft is accepted; outputs stay plain's."""

from __future__ import annotations

from test_engine import cfg, tiny

from treedraft import scheduler
from treedraft.engine import Engine
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree


class OracleAfter:
    """Proposes a 2-token chain: wrong (the oracle's token + 1) before output position ``right_from``, the oracle's
    continuation from there on; records at which output positions it was asked."""

    name = "oracle-after"

    def __init__(self, oracle: list[int], prompt_len: int, right_from: int, vocab: int = 16) -> None:
        self.oracle, self.prompt_len, self.right_from, self.vocab = oracle, prompt_len, right_from, vocab
        self.asked: list[int] = []

    def propose(self, ctx: DraftContext) -> TokenTree:
        n = len(ctx.tokens)
        self.asked.append(n - self.prompt_len)
        nxt = self.oracle[n : n + 2]
        if n - self.prompt_len < self.right_from:
            nxt = [(t + 1) % self.vocab for t in nxt]
        return TokenTree.chain(ctx.root, nxt[: ctx.max_depth])


def run(right_from: int, n: int = 150) -> tuple[list[int], list[int], OracleAfter, list]:
    engine = Engine(tiny(0, vocab=16, max_seq_len=256, scale=2.0))
    prompt = [1, 2, 3, 4]
    ref = engine.generate(prompt, cfg(n), drafter=None).token_ids
    d = OracleAfter(prompt + ref, len(prompt), right_from)
    r = engine.generate(prompt, cfg(n), drafter=d)
    return ref, r.token_ids, d, r.stats.steps


def test_failing_drafts_pause_and_the_output_stays_plain() -> None:
    ref, got, d, steps = run(right_from=10**9)
    assert got == ref
    drafted = [s for s in steps if s.tree_size > 1]
    assert len(drafted) < len(steps) / 3  # most steps plain once drafting stopped paying
    # the first BACKOFF_AFTER steps all drafted, then a pause of BACKOFF_START steps
    assert all(s.tree_size > 1 for s in steps[: scheduler.BACKOFF_AFTER])
    pause = steps[scheduler.BACKOFF_AFTER : scheduler.BACKOFF_AFTER + scheduler.BACKOFF_START]
    assert [s.tree_size for s in pause] == [1] * scheduler.BACKOFF_START
    gaps = [b - a for a, b in zip(d.asked, d.asked[1:], strict=False)]
    assert max(gaps) == scheduler.BACKOFF_MAX + 1  # doubling pauses, capped


def test_drafting_resumes_once_drafts_are_accepted() -> None:
    ref, got, d, steps = run(right_from=60)
    assert got == ref
    late = [a for a in d.asked if a >= 60]
    assert late and late[0] <= 60 + scheduler.BACKOFF_MAX  # a probe came within the longest pause
    after = [s for s in steps[-20:]]
    assert all(s.tree_size > 1 and s.accepted > 0 for s in after[:-1])  # every step drafts and accepts again


def test_right_drafts_never_pause() -> None:
    ref, got, d, steps = run(right_from=0)
    assert got == ref
    assert all(s.tree_size > 1 for s in steps[:-1])
