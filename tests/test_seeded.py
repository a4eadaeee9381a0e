"""Seeded sampling through the engine: a function of (seed, prompt), whatever the drafter and the batch.

The coupled lossless rule (treedraft.verify.accept_coupled) draws token t as the Gumbel-max draw from the target's
p_t with noise keyed by (seed, t, token): over seeds the tokens follow the model exactly (joint of two tokens,
computed from the model itself), and seeded speculative output equals seeded plain output token for token
for deterministic, sampled and stateful (suffix index) drafters. One slow test on the real model.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from conftest import start_threads
from native_utils import make_native, tiny_config
from spec_stats import assert_fits, fits, goodness_of_fit, one_thread  # noqa: F401

from treedraft import kernels, scheduler
from treedraft.drafters.callable import CallableDrafter
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import make_suffix_drafter
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext
from treedraft.models.llama import Transformer
from treedraft.models.tiny import tiny_llama
from treedraft.sampling import SamplingParams, target_probs
from treedraft.tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread")
needs_native = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (exactness needs them)")


# ---- distribution through the engine ----------------------------------------------------------------
V_SMALL = 6
PROMPT = [1, 5, 2, 0, 3]
N_SEEDS = 1200


@torch.inference_mode()
def exact_two_tokens(model: Transformer, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x1, x2) of the model's first two sampled tokens after PROMPT, from its own logits."""

    def probs(ids: list[int]) -> torch.Tensor:
        logits, _ = model.forward(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(16), 0, None)
        return target_probs(logits[0, -1:], params)[0].double()

    p1 = probs(PROMPT)
    return {(a, b): float(p1[a] * probs([*PROMPT, a])[b]) for a in range(V_SMALL) for b in range(V_SMALL)}


class AllTokens:
    """Every token at depth 1 (deterministic): the second token always comes from a tree step."""

    name = "all-tokens"

    def propose(self, ctx: DraftContext) -> TokenTree:
        return TokenTree.from_sequences(ctx.root, [[t] for t in range(V_SMALL)])


def seeded_pairs(engine: Engine, drafter, n: int, params: SamplingParams) -> Counter:
    c = Counter()
    for seed in range(n):
        cfg = GenerationConfig(2, SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        c[tuple(engine.generate(PROMPT, cfg, drafter).token_ids)] += 1
    return c


@pytest.mark.parametrize("drafter", ["plain", "all-tokens"])
def test_seeded_tokens_follow_the_model_over_seeds(drafter: str) -> None:
    """The joint of the first two tokens over N_SEEDS seeds fits the model's exact joint (chi-square)."""
    model = tiny_llama(seed=11, vocab_size=V_SMALL, max_seq_len=32, scale=0.15)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    expected = exact_two_tokens(model, params)
    counts = seeded_pairs(Engine(model), None if drafter == "plain" else AllTokens(), N_SEEDS, params)
    assert_fits(counts, expected, f"{drafter}: first two tokens")


def test_engine_distribution_test_catches_a_misplaced_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keying every draw of a request by its first new position: marginals fine, pairs not."""
    model = tiny_llama(seed=11, vocab_size=V_SMALL, max_seq_len=32, scale=0.15)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    real = scheduler.sample_token
    monkeypatch.setattr(
        scheduler, "sample_token", lambda r, lg, p, g, pos, seed=None: real(r, lg, p, g, len(PROMPT), seed)
    )
    counts = seeded_pairs(Engine(model), None, N_SEEDS // 2, params)
    assert not fits(counts, exact_two_tokens(model, params)), goodness_of_fit(counts, exact_two_tokens(model, params))


# ---- seeded speculative == seeded plain, for every kind of drafter ---------------------------------
V = 64


def native_tiny(seed: int = 0) -> Transformer:
    """A tiny seeded model on native q4 linears (row-invariant: a row's logits do not depend on the tree)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(512, V)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.12)  # default init gives one-hot distributions: soften them
    return make_native(model)


class Replay:
    """Drafts the next tokens of a known output (and one wrong sibling per level): long accepted paths."""

    name = "replay"

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def propose(self, ctx: DraftContext) -> TokenTree:
        done = len(ctx.tokens) - len(self.prompt)
        right = self.output[done : done + 5]
        return TokenTree.from_sequences(ctx.root, [right, *[[(t + 1) % V] for t in right[:1]]])


def suffix_hybrid(store: SuffixStore) -> HybridDrafter:
    """hybrid-suffix without Medusa heads (the tiny model has none): prompt lookup + the suffix index."""
    return HybridDrafter([PromptLookupDrafter(), make_suffix_drafter(store, "", min_match=2)], name="hybrid-suffix")


def sampled_drafter() -> CallableDrafter:
    """Children sampled from a fixed draft distribution (child_q set): still verified by coupled draws."""
    q = {t: 1.0 / 8 for t in range(0, V, 8)}
    return CallableDrafter(lambda prefix: q, V, branching=(3, 2), mode="sample", seed=0, max_workers=1)


@needs_native
def test_seeded_speculative_equals_seeded_plain_for_every_drafter() -> None:
    engine = Engine(native_tiny())
    prompts = [[(3 * i + 7 * j) % V for j in range(6 + 5 * i)] for i in range(3)]
    params = [
        SamplingParams(1.0, seed=1),
        SamplingParams(0.7, top_p=0.9, seed=2),
        SamplingParams(1.3, top_k=20, seed=3),
    ]
    store = SuffixStore()  # shared by every request below, like the server's index: it keeps learning
    drafters = {
        "prompt-lookup": lambda p, out: PromptLookupDrafter(),
        "suffix": lambda p, out: make_suffix_drafter(store, ""),
        "hybrid-suffix": lambda p, out: suffix_hybrid(store),
        "sampled": lambda p, out: sampled_drafter(),
        "replay": Replay,
    }
    accepted = Counter()
    for prompt, sp in itertools.product(prompts, params):
        cfg = GenerationConfig(48, sp)
        plain = engine.generate(prompt, cfg, None).token_ids
        for name, make in drafters.items():
            res = engine.generate(prompt, cfg, make(prompt, plain))
            assert res.token_ids == plain, f"{name}, seed {sp.seed}: speculative output differs from plain"
            accepted[name] += res.stats.accepted_tokens
    # the equality is not vacuous: drafts were accepted (so the walk went down trees), suffix ones included
    assert accepted["replay"] > 100 and accepted["hybrid-suffix"] > 0 and accepted["sampled"] > 0, accepted


@pytest.mark.slow
@pytest.mark.usefixtures("warm_cache")  # int4 kernels from the session's weights=auto measurement
def test_real_model_seeded_default_drafter_equals_plain() -> None:
    """SmolLM2 int4, default drafter (hybrid-suffix) with an index warmed by the same prompt: spec == plain."""
    import treedraft

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    with start_threads():  # this module holds one thread: the session's measurements
        llm = treedraft.load(weights="int4")
        assert llm.engine.drafter.name == "hybrid-suffix"
        text = "Write a short poem about the sea."
        for seed in (1, 2):
            kw = dict(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=seed)
            llm.generate(text, temperature=0.8, seed=seed + 100, max_new_tokens=48)  # feeds the suffix index
            spec = llm.generate(text, **kw)
            plain = llm.generate(text, drafter=None, **kw)
            assert spec.token_ids == plain.token_ids
            assert spec.stats.accepted_tokens > 0
