"""Drafter ``draft-model``: a smaller model of the same tokenizer drafts EAGLE-2 trees. Exactness (greedy = plain,
the sampled distribution), its own KV cache against a fresh recompute (growth included), the errors a user can
cause, and the real model: fp32 target drafted by its own GGUF in int4."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from conftest import load_real_fp32_fixed_plan
from spec_stats import assert_fits, break_the_rule, fits, goodness_of_fit, one_thread, sampled_sequences  # noqa: F401
from test_batch import _batched
from test_engine import Exact

from treedraft import kernels
from treedraft.drafters import draft_model as dm
from treedraft.drafters.draft_model import DraftModelDrafter, DraftModelError, check_same_tokenizer, load_draft_model
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext
from treedraft.models.tiny import tiny_llama
from treedraft.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int, vocab: int = 32, scale: float = 2.0):
    return tiny_llama(seed=seed, vocab_size=vocab, hidden=32, max_seq_len=256, scale=scale)


def near_copy(model, noise: float, seed: int = 1, max_seq_len: int = 256):
    """The target's weights plus seeded noise: a draft that agrees with it often, not always."""
    draft = tiny_llama(seed=0, vocab_size=model.vocab_size, hidden=32, max_seq_len=max_seq_len)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean())
    return draft


def cfg(n: int, sampling: SamplingParams = SamplingParams(), **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, sampling=sampling, ignore_eos=True, **kw)


class CacheCheck:
    """Wraps a DraftModelDrafter; after every propose its cache must hold exactly the committed tokens' keys and
    values, as a fresh causal pass of the draft model over them computes them (drafted rows never stay)."""

    name = "draft-check"

    def __init__(self, d: DraftModelDrafter) -> None:
        self.d, self.checked, self.grown, self.skipped = d, 0, set(), 0

    def propose(self, ctx: DraftContext):
        tree = self.d.propose(ctx)
        n, held = len(ctx.tokens), self.d.cache.length
        # a step that drafted holds the whole context; one that skipped drafting (back-off) catches up later
        assert held == n if len(tree) > 1 else held <= n
        assert self.d.tokens[:held] == list(ctx.tokens[:held])
        fresh = self.d.model.new_cache(n)
        self.d.model.forward(torch.tensor([ctx.tokens]), torch.arange(n), fresh, 0)
        torch.testing.assert_close(self.d.cache.kv[:, :, :, :held], fresh.kv[:, :, :, :held], atol=1e-5, rtol=1e-5)
        self.grown.add(self.d.cache.max_len)
        self.checked += 1
        self.skipped += len(tree) == 1
        return tree


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_spec_equals_plain_and_the_draft_cache_is_a_fresh_recompute(seed: int, monkeypatch) -> None:
    """Greedy output = plain; the draft cache equals a fresh recompute after accepted and rejected steps, also
    across its growth (started at 16 slots here, so a 100-token answer doubles it three times)."""
    monkeypatch.setattr(DraftModelDrafter, "INITIAL_SLOTS", 16)
    model = tiny(seed)
    engine = Engine(model)
    prompt = [5, 3, 8, 1, 9, 2]
    ref = engine.generate(prompt, cfg(100), None).token_ids
    draft = near_copy(model, 0.15, seed)
    d = DraftModelDrafter(draft, model.vocab_size, max_len=256, depth=4, topk=2)
    commit_rows = count_commit_rows(d)
    check = CacheCheck(d)
    r = engine.generate(prompt, cfg(100, max_tree_nodes=8), check)
    assert r.token_ids == ref
    accepted = [s.accepted for s in r.stats.steps]
    assert sum(accepted) > 20 and any(a < s.tree_depth for a, s in zip(accepted, r.stats.steps))  # both kinds
    # accepted drafted rows are kept, not run again: the commits ran the prompt, each step's root and the accepted
    # leaves no draft forward had expanded, far fewer rows than the prompt plus every committed token
    assert sum(commit_rows) < len(prompt) + len(r.token_ids) - 15
    # (the engine skips drafting where drafts have not paid lately: not every step proposes)
    assert check.checked > 10 and max(check.grown) >= 128 and min(check.grown) == 16


def count_commit_rows(d: DraftModelDrafter) -> list[int]:
    """Record the rows of each causal (mask-less: a commit's) forward of ``d``'s draft model into ``d``'s cache."""
    rows: list[int] = []
    forward = d.model.forward

    def counted(tokens, positions, cache=None, start=None, mask=None, logits_for=None):
        if mask is None and cache is d.cache:
            rows.append(tokens.shape[-1])
        return forward(tokens, positions, cache, start, mask, logits_for)

    d.model.forward = counted
    return rows


@pytest.mark.parametrize("noise,draft_cost", [(0.03, 0.05), (1.5, 0.6)])
def test_trees_sized_on_latency_curves_stay_exact_and_back_off(noise: float, draft_cost: float) -> None:
    """With both latency curves the tree is sized for tokens per second: a good cheap draft drafts chains, a poor
    dear one backs off (steps drafting nothing); either way output = plain and the cache holds what it should."""
    model = tiny(5)
    engine = Engine(model)
    prompt = [4, 2, 7, 7, 1]
    ref = engine.generate(prompt, cfg(80), None).token_ids
    target = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.0, 32: 3.2, 64: 6.0}
    dl = {k: draft_cost * v for k, v in target.items()}
    d = DraftModelDrafter(near_copy(model, noise, 3), model.vocab_size, max_len=256, latency=target, draft_latency=dl)
    check = CacheCheck(d)
    r = engine.generate(prompt, cfg(80, max_tree_nodes=16), check)
    assert r.token_ids == ref and check.checked > 5
    if noise < 1:
        assert r.stats.mean_accepted_length > 2.0
    else:
        assert check.skipped > 0  # back-off: trees that did not pay were followed by steps that drafted nothing


def test_a_transformers_draft_model_drafts_up_to_its_own_window(tmp_path, monkeypatch) -> None:
    """A draft model behind the transformers adapter (HFCache: no .kv, another keep) drafts for an own-runtime
    target of the same weights; its cache restarts when it grows, and near the end of the draft's 256-token window
    the trees shrink instead of overflowing it (the target's window is 256 too, the drafter told 300)."""
    transformers = pytest.importorskip("transformers")
    from treedraft.models.hf_adapter import HFTarget
    from treedraft.models.loaders import load_hf_dir

    cfg_hf = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.25,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg_hf).eval()
    hf.save_pretrained(str(tmp_path))
    own = load_hf_dir(tmp_path, torch.float32, "cpu")  # the same weights: the draft agrees with the target
    monkeypatch.setattr(DraftModelDrafter, "INITIAL_SLOTS", 16)
    d = DraftModelDrafter(HFTarget.from_model(hf), 32, max_len=300, depth=6)
    assert d.room == 256
    engine = Engine(own)
    prompt = [3, 9, 4, 1, 8]
    ref = engine.generate(prompt, cfg(250), None).token_ids
    r = engine.generate(prompt, cfg(250, max_tree_nodes=8), d)
    assert r.token_ids == ref and len(ref) == 250
    assert r.stats.mean_accepted_length > 3.0  # the same weights: the drafts are the target's greedy tokens


def test_a_draft_model_with_a_shorter_window_drafts_less_then_nothing_past_it() -> None:
    """A draft model whose window (64) is shorter than the target's: trees get shallower near its end and stop past
    it, never writing past its cache; the output stays plain's."""
    model = tiny(2)
    engine = Engine(model)
    prompt = [7, 1, 4, 4, 9]
    ref = engine.generate(prompt, cfg(120), None).token_ids
    d = DraftModelDrafter(near_copy(model, 0.03, 4, max_seq_len=64), model.vocab_size, max_len=256, depth=6)
    assert d.room == 64
    r = engine.generate(prompt, cfg(120, max_tree_nodes=8), d)
    assert r.token_ids == ref
    drafted = [
        len(prompt) + sum(s.accepted + 1 for s in r.stats.steps[:i])
        for i, s in enumerate(r.stats.steps)
        if s.tree_size > 1
    ]
    assert drafted and max(drafted) < 64  # no tree once the context passed the draft's window


def test_a_request_twin_keeps_its_own_cache_and_the_drafts_respect_the_budget() -> None:
    """for_request gives a twin with its own (empty) cache over the same draft model; trees stay within the node
    budget and depth and are tries rooted at the root."""
    model = tiny(3)
    d = DraftModelDrafter(near_copy(model, 0.1), model.vocab_size, max_len=256, depth=5, topk=3)
    d.propose(DraftContext([1, 2, 3, 4], None, 8, 5))
    twin = d.for_request()
    assert twin.model is d.model and twin.cache is not d.cache and twin.cache.length == 0 and d.cache.length == 4
    for budget, depth in ((2, 5), (5, 2), (12, 5)):
        t = twin.propose(DraftContext([1, 2, 3, 4, 5][: 3 + budget % 3], None, budget, depth))
        assert len(t) <= budget and t.tokens[0] == [1, 2, 3, 4, 5][: 3 + budget % 3][-1]
        assert max(t.depths()) <= depth
        kids = [(p, tok) for tok, p in zip(t.tokens[1:], t.parents[1:])]
        assert len(kids) == len(set(kids))  # a trie: no two children of a node share a token


def sequence_counts(trials: int, n: int = 3, coupled: bool = False, seeded: bool = True) -> tuple[Counter, dict]:
    """Sequences of ``n`` tokens sampled with a draft model, and the exact plain distribution. The draft is close to
    the target, so its sibling children are the target's likely tokens: a rule that mishandles a rejected sibling
    then moves a lot of probability (chi-square 275 against 13.5 for the exact rule, threshold 71). ``coupled``
    False: the top-k trees (siblings), as for a greedy request; True: the draft's own coupled draws (one child)."""
    V = 12
    model = tiny(4, vocab=V, scale=1.0)
    engine = Engine(model)
    prompt = [1, 5, 2]
    expected = Exact(model, SamplingParams(temperature=1.0)).sequences(prompt, n)
    d = DraftModelDrafter(near_copy(model, 0.1, 5), V, max_len=64, depth=2, topk=3)
    with pytest.MonkeyPatch.context() as mp:
        if not coupled:
            mp.setattr(DraftModelDrafter, "_coupled_pick", staticmethod(lambda ctx: None))
        return sampled_sequences(engine, prompt, n, trials, d, seed=900 if seeded else None), expected


def test_sampling_with_a_draft_model_matches_plain_distribution() -> None:
    counts, expected = sequence_counts(1200)
    assert_fits(counts, expected, "speculative sampling with a draft model")


def test_unseeded_sampling_with_coupled_drafts_matches_plain_distribution() -> None:
    """Unseeded requests draw one coupling key each (the draft model drafts its own coupled draws with it): the
    sequences are still distributed as plain sampling's."""
    counts, expected = sequence_counts(1200, coupled=True, seeded=False)
    assert_fits(counts, expected, "unseeded coupled sampling with a draft model")


def test_the_unseeded_check_catches_a_key_shared_by_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails when every unseeded request gets the same coupling key (all draw the same text)."""
    import treedraft.scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "coupling_seed", lambda params, gen: 12345)
    counts, expected = sequence_counts(300, coupled=True, seeded=False)
    assert not fits(counts, expected), goodness_of_fit(counts, expected)


def test_coupled_drafts_are_the_targets_own_draws_and_accepted_more() -> None:
    """For a seeded sampled request the draft model drafts its own coupled draw per position: the output is seeded
    plain's, and a draft equal to the target has every drafted token accepted (its draws are the target's), where
    its argmax chain is accepted only as often as the argmax is drawn (T = 1)."""
    model = tiny(6, scale=1.0)
    engine = Engine(model)
    prompt = [2, 9, 4, 4, 1]
    draft = near_copy(model, 0.0, 7)
    accepted, drafted = {}, 0
    for coupled in (True, False):
        total = 0
        for seed in range(6):
            s = SamplingParams(1.0, seed=seed)
            ref = engine.generate(prompt, cfg(40, s), None).token_ids
            d = DraftModelDrafter(draft, model.vocab_size, max_len=256, depth=6)
            with pytest.MonkeyPatch.context() as mp:
                if not coupled:
                    mp.setattr(DraftModelDrafter, "_coupled_pick", staticmethod(lambda ctx: None))
                r = engine.generate(prompt, cfg(40, s, max_tree_nodes=8), d)
            assert r.token_ids == ref
            total += r.stats.accepted_tokens
            drafted += coupled * sum(st.tree_size - 1 for st in r.stats.steps)
        accepted[coupled] = total
    assert accepted[True] == drafted and accepted[True] > 1.3 * accepted[False], (accepted, drafted)


def test_sampling_check_catches_a_broken_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails when a rejected deterministic draft is not removed from p (no renormalisation)."""
    break_the_rule(monkeypatch)
    counts, expected = sequence_counts(1200)
    assert not fits(counts, expected), goodness_of_fit(counts, expected)


class FakeTok:
    """A tokenizer stand-in: ``hf`` maps ids to token strings."""

    def __init__(self, tokens: list[str]) -> None:
        self.hf = self
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]


def test_a_draft_model_of_another_vocabulary_or_tokenizer_is_refused() -> None:
    model = tiny(0, vocab=32)
    with pytest.raises(DraftModelError, match=r"vocabulary \(40 tokens\) is larger than the target's \(32\)"):
        DraftModelDrafter(tiny(0, vocab=40), 32)
    DraftModelDrafter(tiny(0, vocab=24), 32)  # a smaller vocabulary (a padded target's) drafts ids the target has
    words = [f"t{i}" for i in range(32)]
    check_same_tokenizer(FakeTok(words), FakeTok(words[:30]), "small")  # the same tokens where both have them
    other = words[:7] + ["x"] + words[8:]
    with pytest.raises(
        DraftModelError, match=r"another tokenizer than the target \(1 of 32 token ids differ, e.g. id 7"
    ):
        check_same_tokenizer(FakeTok(words), FakeTok(other), "other")
    # the target's own file in its own weights cannot draft faster than it decodes: said before any load
    model.weights_info = {"resolved": "int4"}
    with pytest.raises(
        DraftModelError, match=r"the target itself in the target's own weights \(int4\).*--weights fp32"
    ):
        load_draft_model(model, None, None, "int4", "smollm2-135m-instruct")
    model.weights_info = {"resolved": "int8"}  # an int8 target drafting with int8: the int4 copy, not --weights int8
    with pytest.raises(DraftModelError, match=r"own weights \(int8\).*give --draft-weights int4"):
        load_draft_model(model, None, None, "int8", "smollm2-135m-instruct")
    model.weights_info = {"resolved": "fp32"}  # a float target asked to draft with its float self: not --weights fp32
    with pytest.raises(DraftModelError, match=r"own weights \(fp32\).*give --draft-weights int4 or int8"):
        load_draft_model(model, None, None, "fp32", "smollm2-135m-instruct")
    with pytest.raises(DraftModelError, match="no draft model given"):
        load_draft_model(model, None, None, "auto", "")


def test_draft_weights_auto_is_int4_on_the_cpu_for_a_gguf() -> None:
    from pathlib import Path

    from treedraft.models.registry import resolve

    gguf, cpu, cuda = resolve("smollm2-135m-instruct"), torch.device("cpu"), torch.device("cuda")
    assert dm.draft_weights_for(gguf, cpu, "auto", torch.float32) == ("int4", "fp32")
    assert dm.draft_weights_for(gguf, cpu, "int8", torch.bfloat16) == ("int8", "fp32")
    assert dm.draft_weights_for(gguf, cpu, "fp32", torch.bfloat16) == ("fp32", "bf16")  # dense: the target's dtype
    assert dm.draft_weights_for(Path("/nonexistent.gguf"), cuda, "fp32", torch.float16) == ("fp32", "fp16")
    with pytest.raises(DraftModelError, match="--draft-weights int4 runs on the CPU only"):
        dm.draft_weights_for(gguf, cuda, "int4", torch.bfloat16)


def test_fp32_target_drafted_by_its_own_int4_file_equals_plain_real_model(monkeypatch) -> None:
    """The real model in fp32, drafted by its own GGUF packed in int4 (load(draft_model=...) makes hybrid-draft the
    drafter): every output equals fp32 plain decoding (the default drafter's too), with trees sized on latency curves
    where verify rows are cheap (so the sized trees draft) and with the whole budget, where the int4 chains must be
    accepted (SmolLM2 int4's top token is fp32's ~98% of the time). The curves are given, not measured: measuring
    the test's fixed fp32 kernel plan (its Python path) and the draft took ~45 s of a cold cache, and priced a 2-row
    verify at ~2x a 1-row one, so the sized drafter drafted rarely; the measurement has its own tests
    (test_budget.py, test_context_latency.py, test_machine_tree.py)."""
    import treedraft.budget
    import treedraft.scheduler

    def curve(model) -> dict[int, float]:  # an int4 forward ~1/5 of an fp32 one; rows cheap up to 8
        one = 0.004 if (getattr(model, "weights_info", None) or {}).get("resolved") == "int4" else 0.02
        return {n: one * f for n, f in ((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.25), (16, 2.0), (32, 3.6), (64, 6.8))}

    for mod in (treedraft.budget, treedraft.scheduler):
        monkeypatch.setattr(mod, "measured_latency", curve)
    llm = load_real_fp32_fixed_plan(draft_model="smollm2-135m-instruct", draft_weights="int4")
    assert llm.engine.drafter.name == "hybrid-draft"  # a draft model given: with suffix chains by default
    sized = llm.drafters.get("draft-model")
    assert sized.name == "draft-model" and sized.model is not llm.model
    assert (sized.model.weights_info or {}).get("resolved") == "int4"
    assert sized.share_kv  # the target's own file: it copies the target's keys and values
    full = DraftModelDrafter(sized.model, llm.model.vocab_size, max_len=llm.model.max_seq_len, latency=None)
    for q in ("Write a short poem about the sea.", "Explain what a hash table is."):
        plain = llm.generate(q, drafter=None, max_new_tokens=64)
        default = llm.generate(q, max_new_tokens=64)
        assert default.token_ids == plain.token_ids
        assert default.stats.mean_accepted_length > 1.5  # the sized trees drafted and were accepted (2.5 / 5.3 here)
        spec = llm.generate(q, drafter=full, max_new_tokens=64, max_tree_nodes=9)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.mean_accepted_length > 4.0


def test_cli_flags_reach_load_and_a_draft_model_picks_the_drafter(monkeypatch) -> None:
    """--draft-model / --draft-weights on generate, serve and bench become load()'s draft_model / draft_weights;
    in load() a draft model given with the default drafter makes draft-model the drafter (an explicit drafter
    stays), and an unknown drafter name still fails before any load."""
    import treedraft
    import treedraft.api as api
    from treedraft.cli import build_parser, draft_kwargs, load_from_args

    ap = build_parser()
    a = ap.parse_args(["generate", "hi", "--draft-model", "small.gguf", "--draft-weights", "int8"])
    assert draft_kwargs(a) == {"draft_model": "small.gguf", "draft_weights": "int8"}
    for argv in (["serve"], ["bench", "--methods", "draft-model"]):
        assert draft_kwargs(ap.parse_args([*argv, "--draft-model", "m"]))["draft_model"] == "m"
    seen: dict = {}
    monkeypatch.setattr(treedraft, "load", lambda *args, **kw: seen.update(kw) or object())
    monkeypatch.setattr(api, "freeze_gc", lambda: 0)
    load_from_args(a)
    assert seen["draft_model"] == "small.gguf" and seen["draft_weights"] == "int8" and seen["drafter"] == "default"

    picked: list = []

    def fake_load_model(*args, **kw):
        raise RuntimeError("stop after the drafter name was checked")

    monkeypatch.setattr(api, "load_model", fake_load_model)
    monkeypatch.setattr(api, "canonical", lambda name: picked.append(name) or name)
    for drafter, want in (("default", "hybrid-draft"), ("suffix", "suffix")):
        with pytest.raises(RuntimeError, match="stop after"):
            api.load(drafter=drafter, draft_model="smollm2-135m-instruct")
        assert picked[-1] == want
    monkeypatch.undo()
    monkeypatch.setattr(api, "load_model", fake_load_model)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        api.load(drafter="nope")
    # the draft options are checked before any load, naming themselves
    with pytest.raises(ValueError, match=r"draft_weights \(--draft-weights\) must be one of auto, fp32, int8, int4"):
        api.load(draft_weights="int3")
    with pytest.raises(ValueError, match=r"draft model \(--draft-model\): .*'/nonexistent.gguf'"):
        api.load(weights="fp32", draft_model="/nonexistent.gguf")
    # options the loaded drafter does not read warn (plain decoding, drafter None, does not)
    with pytest.warns(UserWarning, match="this load drafts with 'medusa', which ignores them"):
        api.warn_unread_draft_args("m", "auto", type("D", (), {"name": "medusa"})())
    with pytest.warns(UserWarning, match="'hybrid-suffix', which ignores them"):
        api.warn_unread_draft_args(None, "int8", type("D", (), {"name": "hybrid-suffix"})())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.warn_unread_draft_args("m", "int8", None)
        api.warn_unread_draft_args("m", "int8", type("D", (), {"name": "hybrid-draft"})())
        api.warn_unread_draft_args(None, "auto", type("D", (), {"name": "medusa"})())


def test_prob_calibration_learns_acceptance_per_draft_probability_and_forks_share_it() -> None:
    """Verified nodes teach P(accepted | parent accepted) per bin of the draft's conditional probability: a chain
    whose p = 0.55 nodes are always accepted and whose p = 0.15 node never is ends with rates near 1 and near 0
    (EAGLE-2's path probability would value the second node at 0.3); request forks learn into the same bins."""
    import math

    from treedraft.drafters.eagle_tree import ProbCalibration
    from treedraft.tree import TokenTree

    cal = ProbCalibration()
    assert cal.rate(0.55) == pytest.approx(0.55) and cal.rate(0.15) == pytest.approx(0.15)  # the prior: p itself
    # root 7 -> 1 -> 2 -> 3, and 7 -> 4 -> 5: node 5 (p 0.55) is never verified (its parent 4 is rejected)
    tree = TokenTree((7, 1, 2, 3, 4, 5), (-1, 0, 1, 2, 0, 4))
    context = list(range(10))
    for k in range(60):
        who = cal if k % 2 else cal.fork()  # every other tree through a request's fork
        who.drafted(1.25, 10, 7, tree, [0.55, 0.55, 0.15, 0.15, 0.55])
        who.learn(context + [7, 1, 2, 9])  # 1 and 2 accepted, 3 and 4 rejected (the target chose 9)
    assert cal.rate(0.55) > 0.95 and cal.rate(0.15) < 0.05
    assert cal.seen[5] > 90  # 2 verified p = 0.55 nodes per tree, 60 trees decayed by 0.995: ~104 (30 trees: ~56)
    d = DraftModelDrafter(tiny(0), 32)
    d.cal = cal
    assert d.for_request().cal.seen is cal.seen and d.fresh().cal.seen.sum() == 0  # fresh: nothing learned
    two = cal.child_key(cal.child_key(0.0, math.log(0.55)), math.log(0.55))
    assert cal.value(two) > 0.9 > 0.05 > cal.value(cal.child_key(0.0, math.log(0.15)))
    cal.drafted(1.0, 10, 7, tree, [0.55, 0.55, 0.15])
    cal.learn([5, 5, 5])  # another sequence: nothing learned
    assert cal.rate(0.55) > 0.95


class SharedCheck:
    """Wraps a ``share_kv`` DraftModelDrafter: every propose must leave the target's cache as it found it (its
    committed keys and values bit for bit, its length) and hold the target's own keys and values for every token before
    the root in its cache, converted to its dtype. ``twin``: a drafter of the same draft model computing its own keys
    and values, asked alongside: the trees must be equal."""

    name = "shared-check"

    def __init__(self, d: DraftModelDrafter, twin: DraftModelDrafter | None = None) -> None:
        self.d, self.twin, self.mirrored, self.same_trees = d, twin, 0, 0

    def propose(self, ctx: DraftContext):
        c = ctx.cache
        n = c.length
        assert n == len(ctx.tokens) - 1  # what the scheduler offers: every token before the root
        held = c.kv[:, :, :, :n].clone()
        tree = self.d.propose(ctx)
        assert c.length == n and torch.equal(c.kv[:, :, :, :n], held)
        if self.d.mirrored == n:  # (a step the calibration skipped mirrors nothing: the next one catches up)
            mine = self.d.cache.kv[:, :, :, :n]
            assert torch.equal(mine, held.to(mine.dtype))
            self.mirrored += 1
        if self.twin is not None:
            other = self.twin.propose(ctx)
            assert (other.tokens, other.parents) == (tree.tokens, tree.parents)
            self.same_trees += 1
        return tree


@pytest.mark.parametrize("seed", [0, 1])
def test_a_draft_of_the_targets_own_model_copies_the_targets_keys_and_values(seed: int) -> None:
    """share_kv (the target's own file in other weights): the draft copies the target's keys and values of the
    committed tokens instead of computing them; output = plain, the target's cache is never written, and with the
    target's own weights as the draft the trees equal those of a draft computing its own (the same keys and values,
    computed twice). The target's fp16 cache is copied into the draft's fp32 one."""
    model = tiny(seed)
    if seed:
        model.kv_dtype = torch.float16
    engine = Engine(model)
    prompt = [5, 3, 8, 1, 9, 2]
    ref = engine.generate(prompt, cfg(80), None).token_ids
    d = DraftModelDrafter(near_copy(model, 0.15, seed), model.vocab_size, max_len=256, depth=4, topk=2, share_kv=True)
    check = SharedCheck(d)
    r = engine.generate(prompt, cfg(80, max_tree_nodes=8), check)
    assert r.token_ids == ref and check.mirrored > 10
    assert sum(s.accepted for s in r.stats.steps) > 15
    if seed:
        return  # (rounded keys and values: a draft computing its own would see others)
    same = near_copy(model, 0.0)
    kw = dict(max_len=256, depth=4, topk=2)
    check = SharedCheck(
        DraftModelDrafter(same, model.vocab_size, share_kv=True, **kw), DraftModelDrafter(same, model.vocab_size, **kw)
    )
    r = engine.generate(prompt, cfg(80, max_tree_nodes=8), check)
    assert r.token_ids == ref and check.same_trees > 10


def test_a_shared_draft_computes_its_own_keys_and_values_where_the_targets_do_not_fit() -> None:
    """A target cache of another layout (a draft with another layer count) or none at all (a caller's own
    DraftContext) is not copied from: the draft computes its keys and values itself, and output stays plain's."""
    model = tiny(2)
    engine = Engine(model)
    prompt = [4, 4, 1, 7]
    ref = engine.generate(prompt, cfg(40), None).token_ids
    other = tiny_llama(seed=3, vocab_size=model.vocab_size, hidden=32, layers=3, max_seq_len=256, scale=2.0)
    d = DraftModelDrafter(other, model.vocab_size, max_len=256, depth=3, share_kv=True)
    check = CacheCheck(d)  # (which checks its cache against the draft's own recompute after every step)
    r = engine.generate(prompt, cfg(40, max_tree_nodes=6), check)
    assert r.token_ids == ref and check.checked > 5 and d.mirrored == 0
    twin = d.for_request()
    assert twin.propose(DraftContext([1, 2, 3], None, 4, 3)).tokens[0] == 3
    assert twin.cache.length == 3 and twin.mirrored == 0


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_shared_drafts_in_a_batch_equal_plain(monkeypatch) -> None:
    """Several requests in one scheduler, each copying from its own target cache (a request twin per request): after
    every copy the twin's cache holds that request's keys and values (outputs alone could not tell a mix-up)."""
    caches: list = []
    mirror = DraftModelDrafter._mirror

    def checked(self, tokens, cache):  # _mirror is a step generator (its root row is a batched draft forward)
        out = yield from mirror(self, tokens, cache)
        r = len(tokens) - 1
        assert torch.equal(self.cache.kv[:, :, :, :r], cache.kv[:, :, :, :r].to(self.cache.kv.dtype))
        if all(c is not cache for c in caches):
            caches.append(cache)
        return out

    monkeypatch.setattr(DraftModelDrafter, "_mirror", checked)
    model = tiny(6)
    engine = Engine(model)
    reqs = [([3, 1, 4, 1, 5][: 2 + i], cfg(20 + 7 * i)) for i in range(4)]
    ref = {i: engine.generate(p, c, None).token_ids for i, (p, c) in enumerate(reqs)}
    d = DraftModelDrafter(near_copy(model, 0.1, 4), model.vocab_size, max_len=256, depth=4, share_kv=True)
    calls = _count_draft_forwards(monkeypatch, d.model)
    out = _batched(engine, reqs, d, step_rows=None, prefill_chunk=None)
    assert out == ref and len(caches) == len(reqs)
    # the scheduler stepped the requests' drafts together: their draft forwards ran packed, up to all four at once (a
    # forward only one request needed runs alone)
    assert max(calls["packed"]) == len(reqs) and len(calls["forward"]) < sum(calls["packed"])


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_the_row_budget_learns_draft_rounds_and_the_positions_that_take_forwards_from_batched_steps(
    monkeypatch,
) -> None:
    """In a budgeted batch (a latency curve) the scheduler tells the row budget each step's rounds of packed draft
    forwards and their time, and per request how many forwards its tree took: a draft model's chain takes one per node
    (the root row, then one per further depth), so its positions are learned as taking rounds, which the budget
    prices."""
    from treedraft.budget import RowBudget

    seen: dict[str, list] = {"drafting": [], "observed": []}
    drafting, observe = RowBudget.observe_drafting, RowBudget.observe

    def on_drafting(self, requests, seconds, rounds=0, round_seconds=0.0):
        seen["drafting"].append((requests, rounds, round_seconds))
        return drafting(self, requests, seconds, rounds, round_seconds)

    def on_observe(self, st, tree_size, accepted, t_draft, pool=True, forwards=0):
        seen["observed"].append((tree_size, forwards, st))
        return observe(self, st, tree_size, accepted, t_draft, pool, forwards)

    monkeypatch.setattr(RowBudget, "observe_drafting", on_drafting)
    monkeypatch.setattr(RowBudget, "observe", on_observe)
    model = tiny(6)
    engine = Engine(model)
    reqs = [([3, 1, 4, 1, 5][: 2 + i], cfg(24)) for i in range(3)]
    ref = {i: engine.generate(p, c, None).token_ids for i, (p, c) in enumerate(reqs)}
    d = DraftModelDrafter(near_copy(model, 0.1, 4), model.vocab_size, max_len=256, depth=4, share_kv=True)
    flat = {1: 0.010, 16: 0.0101, 64: 0.011}  # rows nearly free: drafting pays
    out = _batched(engine, reqs, d, step_rows=None, prefill_chunk=None, latency=flat)
    assert out == ref
    trees = [(n, f) for n, f, _ in seen["observed"] if n > 1]
    assert len(trees) > 5 and all(1 <= f <= min(4, n - 1) for n, f in trees)  # a chain: one forward per node
    stats = {id(st): st for *_, st in seen["observed"]}.values()
    assert all(st.rounds[1] > 0.5 * st.tries[1] for st in stats if st.tries[1] >= 1)  # position 1 took a forward
    batched = [(r, t) for n, r, t in seen["drafting"] if n >= 2]
    assert batched and all(r >= 1 and t > 0 for r, t in batched)


def test_a_shared_draft_switching_between_copying_and_computing_stays_consistent() -> None:
    """Steps offered no target cache (every third here) compute the keys and values the draft lacks; the next copy
    starts after the prefix it still holds from the target: after every step its cache holds, for the tokens before
    the root, the target's own keys and values or, past the last copy, its own recompute. Output = plain."""
    model = tiny(9)
    engine = Engine(model)
    prompt = [6, 2, 6, 3]
    ref = engine.generate(prompt, cfg(60), None).token_ids
    draft = near_copy(model, 0.1, 9)
    d = DraftModelDrafter(draft, model.vocab_size, max_len=256, depth=4, share_kv=True)
    steps = {"copied": 0, "computed": 0}

    class Alternate:
        name = "alternate"

        def propose(self, ctx: DraftContext):
            target, r = ctx.cache, len(ctx.tokens) - 1
            own = sum(steps.values()) % 3 == 2
            tree = d.propose(dataclasses.replace(ctx, cache=None) if own else ctx)
            if d.cache.length < r:
                return tree  # (a step the calibration skipped: nothing run)
            steps["computed" if own else "copied"] += 1
            m = d.mirrored
            assert m <= r
            torch.testing.assert_close(d.cache.kv[:, :, :, :m], target.kv[:, :, :, :m].to(d.cache.kv.dtype))
            fresh = draft.new_cache(r + 1)
            draft.forward(torch.tensor([ctx.tokens]), torch.arange(r + 1), fresh, 0)
            # past the copied slots the draft's own keys and values (computed over the copied prefix: compare loosely)
            torch.testing.assert_close(d.cache.kv[:, :, :, m:r], fresh.kv[:, :, :, m:r], atol=0.2, rtol=0.2)
            return tree

    r = engine.generate(prompt, cfg(60, max_tree_nodes=6), Alternate())
    assert r.token_ids == ref and steps["copied"] > 5 and steps["computed"] > 3


def _count_draft_forwards(monkeypatch, model) -> dict[str, list[int]]:
    """Record the rows of every forward and packed forward of draft ``model`` (segments per packed call)."""
    calls: dict[str, list[int]] = {"forward": [], "packed": []}
    forward, packed = model.forward, model.forward_packed

    def counted_forward(tokens, *a, **kw):
        calls["forward"].append(tokens.shape[-1])
        return forward(tokens, *a, **kw)

    def counted_packed(tokens, positions, segments, *a, **kw):
        calls["packed"].append(len(segments))
        return packed(tokens, positions, segments, *a, **kw)

    monkeypatch.setattr(model, "forward", counted_forward)
    monkeypatch.setattr(model, "forward_packed", counted_packed)
    return calls


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("share_kv", [False, True])
def test_requests_drafting_side_by_side_share_packed_forwards_and_draft_the_same_trees(monkeypatch, share_kv) -> None:
    """Several requests' drafts stepped together (drafters.steps.drive_together): each depth's draft forwards run as ONE
    packed forward of the draft model, and every tree equals the one its drafter drafts alone. (Breaking the packing,
    e.g. another request's rows attending to a wrong cache, changes trees; not packing leaves the count at zero.)"""
    from native_utils import make_native

    from treedraft.drafters.steps import drive_together

    model = tiny(6)
    draft = make_native(near_copy(model, 0.3, 4))  # row-invariant native linears: a packed row is bitwise the row alone
    d = DraftModelDrafter(draft, model.vocab_size, max_len=256, depth=4, topk=2, share_kv=share_kv)
    seqs = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8], [9, 9, 8, 2, 6, 5]]
    caches = []
    for s in seqs:  # the target's own keys and values of each context (what a shared draft copies)
        c = model.new_cache()
        model.forward(torch.tensor([s[:-1]]), torch.arange(len(s) - 1), c, 0)
        c.length = len(s) - 1
        caches.append(c)

    def ctx(i: int) -> DraftContext:
        return dataclasses.replace(DraftContext(seqs[i], None, 9, 4), cache=caches[i] if share_kv else None)

    alone = [d.for_request().propose(ctx(i)) for i in range(len(seqs))]
    twins = [d.for_request() for _ in seqs]
    calls = _count_draft_forwards(monkeypatch, draft)
    rounds: list[float] = []
    forwards = [0] * len(seqs)
    together = drive_together([t.propose_steps(ctx(i)) for i, t in enumerate(twins)], rounds, forwards)
    assert [e for _, e in together] == [None] * len(seqs)
    # what the row budget prices drafting by: each round of packed forwards timed, each drafter's forwards counted
    assert len(rounds) == len(calls["packed"]) and all(t > 0 for t in rounds)
    assert forwards == [len(calls["packed"])] * len(seqs)
    assert [r.tokens for r, _ in together] == [a.tokens for a in alone]
    assert [r.parents for r, _ in together] == [a.parents for a in alone]
    assert all(len(a) > 4 for a in alone)  # real trees: depth 4 with 2 children drafts several nodes
    # one packed forward per depth for all three requests (the root rows too where the target cache is copied)
    assert calls["packed"] and all(n == len(seqs) for n in calls["packed"])
    assert len(calls["packed"]) == (4 if share_kv else 3)
    # without a shared cache each request's commit still runs alone (its causal catch-up is not a step)
    assert len(calls["forward"]) == (0 if share_kv else len(seqs))


def test_stepped_drafts_write_a_grown_draft_cache_outside_inference_mode(monkeypatch) -> None:
    """The server's worker thread is not in inference mode. A draft cache grown inside a step generator is an
    inference tensor; the yielded forwards wrote into it outside that mode and every request of the step failed with
    "Inplace update to inference tensor outside InferenceMode" (a review's live server: HTTP 500 for both requests)."""
    from treedraft.drafters.steps import drive_together

    monkeypatch.setattr(DraftModelDrafter, "INITIAL_SLOTS", 16)
    model = tiny(6)
    d = DraftModelDrafter(near_copy(model, 0.3, 4), model.vocab_size, max_len=256, depth=4, topk=2)
    assert not torch.is_inference_mode_enabled()
    long = [3, 1, 4, 1, 5, 9, 2, 6] * 3  # 24 tokens: past the 16 slots a cache starts with
    a, b = d.for_request(), d.for_request()
    got = drive_together(
        [a.propose_steps(DraftContext(long, None, 9, 4)), b.propose_steps(DraftContext(long[:5], None, 9, 4))]
    )
    assert [e for _, e in got] == [None, None] and len(got[0][0]) > 1
    assert a.cache.max_len >= 32 and len(d.for_request().propose(DraftContext(long, None, 9, 4))) > 1


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_one_requests_failing_draft_forward_fails_only_that_request() -> None:
    """A draft forward that raises (here a malformed mask) used to escape the packed step and fail every request of the
    batch; now the packed group is run job by job, and only the owner gets the error (thrown into its generator)."""
    from native_utils import make_native

    from treedraft.drafters.steps import DraftForward, drive_together

    model = tiny(6)
    draft = make_native(near_copy(model, 0.3, 4))
    d = DraftModelDrafter(draft, model.vocab_size, max_len=256, depth=4, topk=2)
    cleaned = []

    def broken():
        try:
            yield DraftForward(draft, draft.new_cache(), [1, 2], [0, 1], 0, torch.ones(3, 3, dtype=torch.bool))
        finally:
            cleaned.append(True)
        return "never"

    seqs = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    alone = [d.for_request().propose(DraftContext(s, None, 9, 4)) for s in seqs]
    twins = [d.for_request() for _ in seqs]
    got = drive_together([twins[0].propose_steps(DraftContext(seqs[0], None, 9, 4)), broken(),
                          twins[1].propose_steps(DraftContext(seqs[1], None, 9, 4))])  # fmt: skip
    assert got[0][0].tokens == alone[0].tokens and got[2][0].tokens == alone[1].tokens
    assert got[1][0] is None and isinstance(got[1][1], (ValueError, RuntimeError)) and cleaned == [True]


def test_a_drafter_that_overrides_propose_is_driven_through_it() -> None:
    """A subclass (or an instance) wrapping propose must not be bypassed by the inherited propose_steps."""
    from treedraft.drafters.steps import stepping

    model = tiny(6)
    d = DraftModelDrafter(near_copy(model, 0.3, 4), model.vocab_size, max_len=256, depth=4)
    calls = []

    class Logged(DraftModelDrafter):
        def propose(self, ctx):
            calls.append(len(ctx.tokens))
            return super().propose(ctx)

    logged = Logged(d.model, model.vocab_size, max_len=256, depth=4)
    assert stepping(d) is not None and stepping(logged) is None
    wrapped = d.for_request()
    wrapped.propose = lambda ctx, inner=wrapped.propose: inner(ctx)
    assert stepping(wrapped) is None
    engine = Engine(model)
    ref = engine.generate([3, 1, 4], cfg(12), None).token_ids
    assert _batched(engine, [([3, 1, 4], cfg(12))], logged, step_rows=None, prefill_chunk=None)[0] == ref
    assert calls


def test_a_class_level_patch_of_propose_is_not_bypassed_and_twins_still_step(monkeypatch) -> None:
    """Only a propose marked as the driver of its own steps lets the scheduler step a drafter: a class-level patch
    (or a subclass, or an instance wrapper) is driven through propose; plain twins keep stepping (and packing)."""
    from treedraft.drafters.hybrid import HybridDrafter
    from treedraft.drafters.steps import stepping

    model = tiny(6)
    d = DraftModelDrafter(near_copy(model, 0.3, 4), model.vocab_size, max_len=256, depth=4)
    assert stepping(d) is not None and stepping(d.for_request()) is not None and stepping(d.fresh()) is not None
    assert stepping(HybridDrafter([d]).for_request()) is not None
    calls = []
    original = DraftModelDrafter.propose

    def patched(self, ctx):
        calls.append(1)
        return original(self, ctx)

    monkeypatch.setattr(DraftModelDrafter, "propose", patched)
    assert stepping(d) is None and stepping(d.for_request()) is None


def test_a_failed_depth_forward_leaves_no_drafted_slots_behind() -> None:
    """drafted_slots named a depth's cache slots before its forward ran: thrown into at that yield, the drafter kept
    slots that were never written, which a later step would have moved into place as accepted drafts."""
    model = tiny(6)
    d = DraftModelDrafter(near_copy(model, 0.3, 4), model.vocab_size, max_len=256, depth=4, topk=2).for_request()
    steps = d.propose_steps(DraftContext([3, 1, 4, 1, 5], None, 9, 4))
    job = next(steps)  # the first tree depth (no shared cache: the commit ran inline)
    with pytest.raises(RuntimeError, match="boom"):
        steps.throw(RuntimeError("boom"))
    assert d.drafted_slots == {} and job.start == d.cache.length
