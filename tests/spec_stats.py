"""Goodness-of-fit helpers for the distribution tests (empirical counts vs an exact distribution)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping

import pytest
import torch
from torch import Tensor

from treedraft.tree import TokenTree
from treedraft.verify import Acceptance

Rule = Callable[[TokenTree, Tensor, torch.Generator], Acceptance]

Z = 4.75  # one-sided normal quantile for a false-alarm rate of ~1e-6 per check


def chi2_threshold(df: int, z: float = Z) -> float:
    """Upper chi-square quantile (Wilson-Hilferty approximation), df >= 1."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def goodness_of_fit(counts: Counter, expected: Mapping[Hashable, float], min_expected: float = 5.0) -> dict:
    """Chi-square statistic of ``counts`` against probabilities ``expected`` (rare cells pooled).

    Returns statistic, df, threshold, total variation distance and the outcomes seen that
    have zero expected probability (any of them is a failure by itself).
    """
    n = sum(counts.values())
    impossible = sorted((k for k in counts if expected.get(k, 0.0) <= 0.0), key=repr)
    stat, df, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for k, p in expected.items():
        if p <= 0.0:
            continue
        e, o = n * p, counts.get(k, 0)
        if e < min_expected:
            pool_o += o
            pool_e += e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    df = max(df, 1)
    keys = set(counts) | set(expected)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - expected.get(k, 0.0)) for k in keys)
    return {"stat": stat, "df": df, "threshold": chi2_threshold(df), "tv": tv, "impossible": impossible, "n": n}


def fits(counts: Counter, expected: Mapping[Hashable, float]) -> bool:
    """True when the counts are consistent with ``expected`` (no impossible outcome, chi-square below bound)."""
    r = goodness_of_fit(counts, expected)
    return not r["impossible"] and r["stat"] <= r["threshold"]


def assert_fits(counts: Counter, expected: Mapping[Hashable, float], what: str = "") -> None:
    """Fail with the full statistics when counts do not fit ``expected``."""
    r = goodness_of_fit(counts, expected)
    assert not r["impossible"], f"{what}: outcomes with zero target probability occurred: {r['impossible'][:5]}"
    assert r["stat"] <= r["threshold"], f"{what}: distribution mismatch {r}"


@pytest.fixture(scope="module", autouse=False)
def one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention on a shared machine (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_rule(renorm: bool = True, update_q: bool = True, swap: bool = False, ignore_q: bool = False) -> Rule:
    """An independent re-implementation whose flags break it on purpose (to show the test can fail)."""

    def rule(tree: TokenTree, probs: Tensor, gen: torch.Generator) -> Acceptance:
        kids = tree.children()
        node, path = 0, [0]
        while True:
            p = probs[node].double().clone()
            q = tree.child_q.get(node)
            q = None if (q is None or ignore_q) else q.double().clone()
            for c in kids[node]:
                x = tree.tokens[c]
                u = float(torch.rand((), generator=gen, dtype=torch.float64))
                if q is None:
                    ratio, residual = float(p[x]), p.clone()
                    residual[x] = 0.0
                else:
                    ratio = float(q[x] / p[x]) if swap and p[x] > 0 else float(p[x] / q[x])
                    residual = (p - q).clamp_min(0.0)
                if u < ratio:
                    path.append(c)
                    node = c
                    break
                p = residual / residual.sum() if renorm else residual
                if q is not None and update_q:
                    q[x] = 0.0
                    q = q / q.sum()
            else:  # (an all-zero unnormalised residual falls back to the target)
                p = p if p.sum() > 0 else probs[node].double()
                return Acceptance(tuple(path), int(torch.multinomial(p, 1, generator=gen)))

    return rule


def sampled_sequences(engine, prompt: list[int], n: int, trials: int, drafter, seed: int | None = 500) -> Counter:
    """Sequences of ``n`` tokens sampled at temperature 1 (seeds ``seed``, ``seed + 1``, ...; None: unseeded) with
    ``drafter``, a tree budget of 8; asserts drafts were accepted (and so rejected too) in more than half the trials'
    worth of tokens, so the acceptance rule mattered."""
    from treedraft.engine import GenerationConfig
    from treedraft.sampling import SamplingParams

    counts: Counter = Counter()
    accepted = 0
    for i in range(trials):
        cfg = GenerationConfig(
            max_new_tokens=n,
            sampling=SamplingParams(1.0, seed=None if seed is None else seed + i),
            ignore_eos=True,
            max_tree_nodes=8,
        )
        r = engine.generate(prompt, cfg, drafter)
        counts[tuple(r.token_ids)] += 1
        accepted += r.stats.accepted_tokens
    assert accepted > trials / 2  # drafts were accepted (and rejected), so the rule mattered
    return counts


def break_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engine accept with :func:`reference_rule` (``renorm=False``): a rejected deterministic draft is not
    removed from p, which a distribution test must catch."""
    import treedraft.scheduler as scheduler_mod
    from treedraft.sampling import target_probs

    wrong = reference_rule(renorm=False)
    monkeypatch.setattr(
        scheduler_mod,
        "accept",
        lambda rule, tree, logits, params, gen, position=None, seed=None: wrong(
            tree, target_probs(logits, params), gen
        ),
    )
