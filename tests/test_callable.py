"""Model-agnostic mode: the engine over plain callables (a toy bigram target and draft)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from spec_stats import assert_fits, one_thread  # noqa: F401 (fixture)

from treedraft.drafters.callable import CallableDrafter
from treedraft.engine import Engine, GenerationConfig, GenerationStats
from treedraft.interfaces import DraftContext
from treedraft.models.callable_target import CallableTarget, TokenCache
from treedraft.sampling import SamplingParams, target_probs
from treedraft.tree import TokenTree, full_attention_mask, tree_positions

pytestmark = pytest.mark.usefixtures("one_thread")

V = 8


def table(seed: int, sharp: float) -> torch.Tensor:
    """(V, V) bigram next-token probabilities."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * sharp, -1)


TARGET = table(0, 2.0)
DRAFT = table(1, 2.0) * 0.5 + TARGET * 0.5  # related but different


def bigram(tab: torch.Tensor):
    """A toy model: next-token distribution from the last token and the context length's parity."""

    def fn(tokens: list[int]) -> dict[int, float]:
        row = tab[tokens[-1]] if len(tokens) % 2 else tab[(tokens[-1] + 3) % V]
        return {t: float(p) for t, p in enumerate(row) if p > 0}

    return fn


def cfg(n: int, sampling: SamplingParams = SamplingParams()) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, sampling=sampling, ignore_eos=True)


def direct_greedy(fn, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        d = fn(toks)
        toks.append(max(sorted(d), key=lambda t: d[t]))  # ties -> smallest id, like argmax
    return toks[len(prompt) :]


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_greedy_equals_plain(mode: str) -> None:
    with CallableTarget(bigram(TARGET), V) as target:
        engine = Engine(target)
        for i, prompt in enumerate([[1], [2, 5], [7, 7, 0, 3]]):
            ref = direct_greedy(bigram(TARGET), prompt, 20)
            assert engine.generate(prompt, cfg(20), drafter=None).token_ids == ref
            drafter = CallableDrafter(bigram(DRAFT), V, branching=(3, 2, 2), mode=mode, seed=i)
            r = engine.generate(prompt, cfg(20), drafter)
            assert r.token_ids == ref
            assert r.stats.accepted_tokens > 0
            drafter.close()


def exact_sequences(fn, params: SamplingParams, prompt: list[int], n: int) -> dict:
    """Plain sampling's exact sequence distribution, straight from the callable."""
    out = {}

    def rec(seq: tuple[int, ...], pr: float) -> None:
        if len(seq) == n:
            out[seq] = pr
            return
        lp = torch.full((V,), float("-inf"))
        for t, p in fn(prompt + list(seq)).items():
            lp[t] = torch.tensor(p).log()
        probs = target_probs(lp[None], params)[0].double()
        for t in torch.nonzero(probs > 0).flatten().tolist():
            rec(seq + (t,), pr * float(probs[t]))

    rec((), 1.0)
    return out


@pytest.mark.parametrize(
    "mode, params, draft",
    [
        ("sample", SamplingParams(temperature=1.0, top_k=4), table(3, 2.0)),
        ("topk", SamplingParams(temperature=0.9, top_p=0.85), DRAFT),
    ],
    ids=["sampled-children-topk4", "topk-children-top_p"],
)
def test_sampling_distribution_matches_plain(mode: str, params: SamplingParams, draft: torch.Tensor) -> None:
    prompt, n, trials = [3, 6], 3, 2000
    expected = exact_sequences(bigram(TARGET), params, prompt, n)
    counts: Counter = Counter()
    accepted = 0
    drafter = CallableDrafter(bigram(draft), V, branching=(3, 3), mode=mode, seed=5, max_workers=1)
    with CallableTarget(bigram(TARGET), V, max_workers=4) as target:
        engine = Engine(target)
        for i in range(trials):
            s = SamplingParams(params.temperature, params.top_k, params.top_p, seed=i)
            r = engine.generate(prompt, cfg(n, s), drafter)
            counts[tuple(r.token_ids)] += 1
            accepted += r.stats.accepted_tokens
    drafter.close()
    assert_fits(counts, expected, f"callable target, {mode} drafter")
    assert accepted > trials / 10


def test_tree_nodes_are_evaluated_concurrently_with_their_own_contexts() -> None:
    lock = threading.Lock()
    active, peak, seen = [0], [0], []

    def slow(tokens: list[int]) -> dict[int, float]:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            seen.append(tuple(tokens))
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return bigram(TARGET)(tokens)

    target = CallableTarget(slow, V, max_workers=16)
    cache = target.new_cache(64)
    committed = [1, 2, 3]
    target.forward(torch.tensor([committed]), torch.arange(3), cache, 0, logits_for=slice(-1, None))
    cache.keep(0, range(3))
    assert seen == [(1, 2, 3)]  # prefill asks only for the row it needs
    seen.clear()
    tree = TokenTree.from_sequences(4, [[5, 6, 7], [5, 1], [6, 2, 3], [0], [1], [2], [3, 3]])
    t0 = time.perf_counter()
    logits, hidden = target.forward(
        torch.tensor([tree.tokens]), tree_positions(tree, 3), cache, 3, full_attention_mask(tree, 3)
    )
    elapsed = time.perf_counter() - t0
    n = len(tree)
    assert logits.shape == (1, n, V) and hidden is None
    expected = {tuple(committed + [tree.tokens[j] for j in tree.path_to(i)]) for i in range(n)}
    assert set(seen) == expected and len(seen) == n  # node i sees committed + its own path
    assert peak[0] >= 8  # the nodes overlapped
    assert elapsed < 0.05 * n / 3  # far below the serial time
    for i in range(n):  # logits are the log-probabilities of each node's context
        d = bigram(TARGET)(committed + [tree.tokens[j] for j in tree.path_to(i)])
        torch.testing.assert_close(logits[0, i].exp(), torch.tensor([d.get(t, 0.0) for t in range(V)]).float())
    # compaction keeps the accepted path only
    path = tree.path_to(next(i for i in range(n) if tree.tokens[i] == 7))
    cache.keep(3, path)
    assert cache.tokens == committed + [tree.tokens[i] for i in path]
    target.close()


def test_engine_runs_concurrently_over_a_slow_target() -> None:
    lock = threading.Lock()
    active, peak = [0], [0]

    def slow(tokens: list[int]) -> dict[int, float]:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1
        return bigram(TARGET)(tokens)

    with CallableTarget(slow, V) as target:
        drafter = CallableDrafter(bigram(DRAFT), V, branching=(3, 2), mode="topk")
        stats = GenerationStats()
        ids = Engine(target).generate([1, 2], cfg(12), drafter).token_ids
        list(Engine(target).decode([1, 2], cfg(12), drafter, stats))
        drafter.close()
    assert ids == direct_greedy(bigram(TARGET), [1, 2], 12)
    assert peak[0] >= 3
    assert stats.mean_accepted_length > 1.0


def test_token_cache() -> None:
    c = TokenCache(6)
    c.write(0, [1, 2, 3])
    c.keep(0, [0, 1, 2])
    c.write(3, [7, 8, 9])
    c.keep(3, [0, 2])
    assert c.tokens == [1, 2, 3, 7, 9] and c.length == 5
    with pytest.raises(ValueError, match="overflow"):
        c.write(5, [1, 2])
    c.truncate(2)
    assert c.tokens == [1, 2]


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (lambda toks: {V: 1.0}, ValueError, "outside the vocabulary"),
        (lambda toks: {3.0: 1.0}, ValueError, "token ids must be integers"),
        (lambda toks: {0: -1.0, 1: 1.0}, ValueError, "probability"),
        (lambda toks: {}, ValueError, "no probability mass"),
        (lambda toks: [0.5, 0.5], TypeError, "expected a dict"),
    ],
)
def test_bad_target_output_is_reported(bad, err: type, match: str) -> None:
    target = CallableTarget(bad, V, name="remote-llm")
    with pytest.raises(err, match=match) as e:
        Engine(target).generate([1, 2], cfg(3), drafter=None)
    assert "remote-llm" in str(e.value)


def test_drafter_shapes() -> None:
    ctx = DraftContext(tokens=[1, 2, 3], hidden=None, max_nodes=64, max_depth=8)
    d = CallableDrafter(bigram(DRAFT), V, branching=(3, 2, 1), mode="topk")
    tree = d.propose(ctx)
    assert len(tree) == 1 + 3 + 6 + 6 and max(tree.depths()) == 3 and not tree.child_q
    q = torch.tensor([bigram(DRAFT)([1, 2, 3]).get(t, 0.0) for t in range(V)])
    assert [tree.tokens[c] for c in tree.children()[0]] == q.topk(3).indices.tolist()
    s = CallableDrafter(bigram(DRAFT), V, branching=(3, 2, 1), mode="sample", seed=0)
    tree = s.propose(ctx)
    kids = tree.children()
    assert set(tree.child_q) == {i for i in range(len(tree)) if kids[i]}
    torch.testing.assert_close(tree.child_q[0].float(), q / q.sum())
    small = s.propose(DraftContext(tokens=[1, 2, 3], hidden=None, max_nodes=5, max_depth=1))
    assert len(small) == 4 and max(small.depths()) == 1
    tiny = s.propose(DraftContext(tokens=[1, 2, 3], hidden=None, max_nodes=3, max_depth=5))
    assert len(tiny) == 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        CallableDrafter(lambda p: {V + 1: 1.0}, V, name="bad-draft").propose(ctx)
    # NumPy integer keys (what an argsort hands back) are token ids like ints, for the drafter and the target
    import numpy as np

    as_np = CallableDrafter(lambda p: {np.int64(k): v for k, v in bigram(DRAFT)(p).items()}, V, branching=(3, 2, 1))
    assert as_np.propose(ctx).tokens == CallableDrafter(bigram(DRAFT), V, branching=(3, 2, 1)).propose(ctx).tokens
    target = CallableTarget(lambda toks: {np.int32(k): v for k, v in bigram(DRAFT)(toks).items()}, V)
    assert torch.equal(target.log_probs([1, 2, 3]), CallableTarget(bigram(DRAFT), V).log_probs([1, 2, 3]))
    with pytest.raises(ValueError, match="mode"):
        CallableDrafter(bigram(DRAFT), V, mode="beam")


def test_the_readme_example_runs_and_a_tokenizer_less_llm_says_what_to_do(capsys) -> None:
    """README's callable-mode example (executed from the README itself) prints the target's own greedy tokens;
    an LLM around a callable target, which has no tokenizer, says to pass token ids instead of failing on None."""
    import re
    from pathlib import Path

    from treedraft.api import LLM
    from treedraft.interfaces import GenerationError

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "CallableTarget(" in b)
    exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("[7, 8, 9, 10, 11, 12, 13, 14] ")
    llm = LLM(Engine(CallableTarget(bigram(TARGET), V)), None, "remote", "cpu", heads=None)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match="no tokenizer"):
        llm.generate("hi")
