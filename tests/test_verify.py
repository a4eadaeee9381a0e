"""Acceptance rules: greedy on handmade logits, lossless sampling by distribution, typical thresholds."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from spec_stats import Rule, assert_fits, fits, goodness_of_fit, one_thread, reference_rule  # noqa: F401
from torch import Tensor

from treedraft import verify
from treedraft.sampling import SamplingParams, inverse_cdf, position_uniform, target_probs
from treedraft.tree import TokenTree
from treedraft.verify import (
    Acceptance,
    accept,
    accept_greedy,
    accept_speculative,
    accept_typical,
    sample_token,
    uses_coupling,
)

V = 6
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- greedy --------------------------------------------------------------
def onehot_logits(best: list[int]) -> Tensor:
    lg = torch.randn(len(best), V, generator=torch.Generator().manual_seed(0))
    for i, b in enumerate(best):
        lg[i, b] = 10.0
    return lg


def test_greedy_follows_argmax_path_and_bonus() -> None:
    #        0(root)
    #       /       \
    #     1:3       2:5
    #      |         |
    #     3:0       4:1
    #                |
    #               5:2
    tree = TokenTree((9, 3, 5, 0, 1, 2), (-1, 0, 0, 1, 2, 4))
    # argmax per node: root->5 (node 2), node2->1 (node 4), node4->4 (no child 4 -> bonus 4)
    a = accept_greedy(tree, onehot_logits([5, 0, 1, 0, 4, 3]))
    assert a == Acceptance((0, 2, 4), 4)
    # full depth accepted: bonus comes from the leaf
    a = accept_greedy(tree, onehot_logits([5, 0, 1, 0, 2, 3]))
    assert a == Acceptance((0, 2, 4, 5), 3)
    # nothing matches: root only, bonus = root argmax
    a = accept_greedy(tree, onehot_logits([4, 0, 1, 0, 2, 3]))
    assert a == Acceptance((0,), 4)
    # dispatch with greedy params uses the greedy rule whatever the rule name
    assert accept(
        "speculative", tree, onehot_logits([3, 0, 1, 0, 2, 3]), SamplingParams(), torch.Generator()
    ) == Acceptance((0, 1, 3), 0)


def test_accept_dispatch_errors() -> None:
    tree = TokenTree((0, 1), (-1, 0))
    with pytest.raises(ValueError, match="temperature 0"):
        accept("greedy", tree, torch.zeros(2, V), SamplingParams(temperature=1.0), torch.Generator())
    with pytest.raises(ValueError, match="unknown acceptance rule"):
        accept("nope", tree, torch.zeros(2, V), SamplingParams(temperature=1.0), torch.Generator())


# ---- lossless speculative sampling: distribution checks ---------------------
G = torch.Generator().manual_seed(1234)
P0 = torch.tensor([0.34, 0.26, 0.15, 0.12, 0.08, 0.05], dtype=torch.float64)  # target at the root
P1 = torch.softmax(torch.randn(V, V, generator=G, dtype=torch.float64) * 1.5, -1)  # target after token x
P1[:, 5] = 0.0  # a zero-probability token the drafts can still propose
P1 = P1 / P1.sum(-1, keepdim=True)
Q0 = torch.tensor([0.02, 0.03, 0.75, 0.10, 0.05, 0.05], dtype=torch.float64)  # peaked draft != target
Q1 = torch.roll(P1, 1, dims=-1) * 0.5 + 0.5 / V  # draft after token x, full support
Q1 = Q1 / Q1.sum(-1, keepdim=True)
P2 = torch.full((V,), 1.0 / V, dtype=torch.float64)  # target two levels down (only feeds the bonus)


def draw_without_replacement(q: Tensor, k: int, gen: torch.Generator) -> list[int]:
    rest, out = q.clone(), []
    for _ in range(k):
        t = int(torch.multinomial(rest, 1, generator=gen))
        out.append(t)
        rest[t] = 0.0
    return out


def build_tree(root_kids: list[int] | int, kid_kids: dict[int, list[int]] | int, gen: torch.Generator) -> TokenTree:
    """Depth-2 tree. An int instead of a token list = that many children sampled from Q0 / Q1[x]."""
    tokens, parents, child_q = [7 % V], [-1], {}
    if isinstance(root_kids, int):
        child_q[0] = Q0
        root_kids = draw_without_replacement(Q0, root_kids, gen)
    level1 = []
    for t in root_kids:
        level1.append(len(tokens))
        tokens.append(t)
        parents.append(0)
    for node in level1:
        x = tokens[node]
        if isinstance(kid_kids, int):
            if kid_kids == 0:
                continue
            child_q[node] = Q1[x]
            kids = draw_without_replacement(Q1[x], kid_kids, gen)
        else:
            kids = kid_kids.get(x, [])
        for t in kids:
            tokens.append(t)
            parents.append(node)
    return TokenTree(tuple(tokens), tuple(parents), child_q)


def probs_for(tree: TokenTree) -> Tensor:
    """(N, V) target distribution at every node: P0 at the root, P1[x] after x, P2 deeper."""
    d = tree.depths()
    rows = [P0 if d[i] == 0 else P1[tree.tokens[i]] if d[i] == 1 else P2 for i in range(len(tree))]
    return torch.stack(rows).float()


def two_tokens(tree: TokenTree, a: Acceptance, gen: torch.Generator) -> tuple[int, int]:
    """First two emitted tokens; when only one is emitted, the next comes from plain sampling (P1)."""
    emitted = [tree.tokens[i] for i in a.nodes[1:]] + [a.bonus]
    if len(emitted) == 1:
        emitted.append(int(torch.multinomial(P1[emitted[0]], 1, generator=gen)))
    return emitted[0], emitted[1]


EXPECTED_1 = {x: float(P0[x]) for x in range(V)}
EXPECTED_2 = {(x, y): float(P0[x] * P1[x, y]) for x in range(V) for y in range(V)}

# (root children, children of depth-1 nodes): lists are deterministic tokens, ints are sampled counts
TREES = {
    "deterministic": ([0, 2, 5, 1], {0: [1, 0, 5], 2: [3], 1: [0, 1, 2, 3, 4]}),
    "sampled": (3, 2),
    "mixed": ([2, 0, 4], 3),
    "sampled-then-deterministic": (4, {0: [0, 1], 2: [2], 3: [3, 1]}),
    "one-sampled-chain": (1, 1),
}


def run(rule: Rule, shape: tuple, n: int, seed: int) -> tuple[Counter, Counter]:
    gen, tgen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    fixed = None if any(isinstance(s, int) for s in shape) else build_tree(*shape, tgen)
    c1, c2 = Counter(), Counter()
    for _ in range(n):
        tree = fixed or build_tree(*shape, tgen)  # sampled drafts are redrawn every trial
        a = rule(tree, probs_for(tree), gen)
        pair = two_tokens(tree, a, gen)
        c1[pair[0]] += 1
        c2[pair] += 1
    return c1, c2


N = 3000
SEEDS = {shape: 101 + 17 * i for i, shape in enumerate(TREES)}  # fixed per shape (str hash() changes per process)


@pytest.mark.parametrize("shape", list(TREES), ids=list(TREES))
def test_speculative_emits_target_distribution(shape: str) -> None:
    c1, c2 = run(accept_speculative, TREES[shape], N, seed=SEEDS[shape])
    assert_fits(c1, EXPECTED_1, f"{shape}: first token")
    assert_fits(c2, EXPECTED_2, f"{shape}: first two tokens")


WRONG = {
    "no-renormalisation": (reference_rule(renorm=False), "deterministic"),
    "q-instead-of-p": (reference_rule(swap=True), "sampled"),
    "q-not-updated-(iid-rule-on-distinct-draws)": (reference_rule(update_q=False), "sampled"),
}


def test_reference_rule_passes() -> None:
    """The harness accepts the correct reference rule, so the failures below are the flags' doing.

    Treating sampled children as deterministic ones is lossless too (the point-mass rule is exact
    for any tree drawn independently of the coins), it just accepts less often.
    """
    for shape in ("deterministic", "sampled", "sampled/ignore-q"):
        rule = reference_rule(ignore_q=shape.endswith("ignore-q"))
        shape = shape.split("/")[0]
        c1, c2 = run(rule, TREES[shape], N, seed=5)
        assert_fits(c1, EXPECTED_1, shape)
        assert_fits(c2, EXPECTED_2, shape)


@pytest.mark.parametrize("name", list(WRONG), ids=list(WRONG))
def test_wrong_rules_are_caught(name: str) -> None:
    rule, shape = WRONG[name]
    c1, c2 = run(rule, TREES[shape], N, seed=5)
    assert not (fits(c1, EXPECTED_1) and fits(c2, EXPECTED_2)), (
        f"the distribution test did not notice the broken rule {name}: "
        f"{goodness_of_fit(c1, EXPECTED_1)} {goodness_of_fit(c2, EXPECTED_2)}"
    )


# ---- the coupled lossless rule: token t = F_t^-1(u(seed, t)) -----------------------------------------
POS = 11  # absolute position of the token the root predicts


def run_coupled(shape: tuple, n: int, draft_seed: int = 9) -> tuple[Counter, Counter]:
    """First two tokens over seeds 0..n-1: the coupled tree step, then (one token emitted) a seeded plain step."""
    tgen = torch.Generator().manual_seed(draft_seed)
    fixed = None if any(isinstance(s, int) for s in shape) else build_tree(*shape, tgen)
    c1, c2 = Counter(), Counter()
    gen = torch.Generator().manual_seed(0)  # unused by seeded requests (asserted below)
    state = gen.get_state()
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        tree = fixed or build_tree(*shape, tgen)
        a = accept("speculative", tree, probs_for(tree).log(), params, gen, position=POS)
        emitted = [tree.tokens[i] for i in a.nodes[1:]] + [a.bonus]
        if len(emitted) == 1:  # the next step: plain, at the next position
            emitted.append(sample_token("speculative", P1[emitted[0]].float().log(), params, gen, POS + 1))
        c1[emitted[0]] += 1
        c2[emitted[0], emitted[1]] += 1
    assert torch.equal(gen.get_state(), state), "a seeded coupled draw used the request's generator"
    return c1, c2


@pytest.mark.parametrize("shape", ["deterministic", "sampled", "mixed"])
def test_coupled_emits_target_distribution(shape: str) -> None:
    """Over seeds, the coupled rule's first two tokens follow the target exactly, whatever the drafts."""
    c1, c2 = run_coupled(TREES[shape], N)
    assert_fits(c1, EXPECTED_1, f"{shape}: first token")
    assert_fits(c2, EXPECTED_2, f"{shape}: first two tokens")


def _broken_keys(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Break the production rule's keying: one uniform for every position, or keys by depth in the tree."""
    orig = verify.coupled_sample
    if how == "reused-across-positions":
        monkeypatch.setattr(verify, "coupled_sample", lambda lg, p, seed, t: orig(lg, p, seed, 0))
    else:  # depth = position - the step's base: the tree step starts at POS, the plain step after it at POS + 1
        base = {"step": POS}

        def by_depth(lg: Tensor, p: SamplingParams, seed: int, t: int) -> int:
            return orig(lg, p, seed, t - base["step"])

        real_accept = verify.accept_coupled

        def accept_then_plain(tree, logits, params, seed, position):
            base["step"] = position
            a = real_accept(tree, logits, params, seed, position)
            base["step"] = position + len(a.nodes)  # where the next (plain) step starts
            return a

        monkeypatch.setattr(verify, "coupled_sample", by_depth)
        monkeypatch.setattr(verify, "accept_coupled", accept_then_plain)


@pytest.mark.parametrize("how", ["reused-across-positions", "keyed-by-depth"])
def test_broken_coupling_keys_are_caught(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Each token's marginal stays right with a broken key, but consecutive tokens become dependent."""
    _broken_keys(monkeypatch, how)
    c1, c2 = run_coupled(TREES["deterministic"], N)
    assert fits(c1, EXPECTED_1), goodness_of_fit(c1, EXPECTED_1)  # the marginal alone cannot tell
    assert not fits(c2, EXPECTED_2), f"broken keys ({how}) went unnoticed: {goodness_of_fit(c2, EXPECTED_2)}"


def test_coupled_output_does_not_depend_on_the_tree() -> None:
    """Same seed and target, any tree: the emitted tokens are a prefix of the same sequence."""
    params = SamplingParams(temperature=1.0, seed=42)
    rows = {0: P0.float().log(), **{x + 1: P1[x].float().log() for x in range(V)}}  # row key: last token + 1
    ref, last = [], 7 % V
    for d in range(3):  # plain seeded decoding: POS, POS + 1, POS + 2 (P1 after any token)
        last = sample_token("speculative", rows[0] if d == 0 else rows[last + 1], params, torch.Generator(), POS + d)
        ref.append(last)
    for shape in TREES.values():
        for k in range(20):
            tree = build_tree(*shape, torch.Generator().manual_seed(k))
            d = tree.depths()
            logits = torch.stack([rows[0] if d[i] == 0 else rows[tree.tokens[i] + 1] for i in range(len(tree))])
            a = accept("speculative", tree, logits, params, torch.Generator(), position=POS)
            out = [tree.tokens[i] for i in a.nodes[1:]] + [a.bonus]
            assert out == ref[: len(out)], (tree, out, ref)


def test_position_uniform_and_inverse_cdf() -> None:
    us = [position_uniform(3, t) for t in range(4000)]
    assert us == [position_uniform(3, t) for t in range(4000)]  # a pure function of (seed, t)
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == len(us)
    assert position_uniform(4, 0) != position_uniform(3, 0) and position_uniform(-1, 5) == position_uniform(
        2**64 - 1, 5
    )
    assert_fits(Counter(int(u * 10) for u in us), {b: 0.1 for b in range(10)}, "uniform deciles")
    with pytest.raises(ValueError, match="position"):
        position_uniform(0, -1)
    p = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    assert [inverse_cdf(p, u) for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 1.0 - 2**-53)] == [1, 1, 3, 3, 4, 4]
    assert inverse_cdf(p * 3, 0.5) == 3  # unnormalised is fine
    with pytest.raises(ValueError, match="no mass"):
        inverse_cdf(torch.zeros(4), 0.5)


def test_uses_coupling() -> None:
    seeded, unseeded = SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.7)
    sampled = TokenTree((0, 1), (-1, 0), {0: torch.full((V,), 1.0 / V)})
    det = TokenTree((0, 1), (-1, 0))
    assert uses_coupling("speculative", seeded, sampled) and uses_coupling("speculative", seeded, det)
    assert uses_coupling("speculative", unseeded, det) and not uses_coupling("speculative", unseeded, sampled)
    assert not uses_coupling("typical", seeded, det) and not uses_coupling("speculative", SamplingParams(), det)
    with pytest.raises(ValueError, match="position"):
        accept("speculative", det, torch.zeros(2, V), seeded, torch.Generator())


@pytest.mark.parametrize("form", ["coupled", "rejection", "coupled-seeded"])
def test_speculative_respects_top_k(form: str) -> None:
    """Filtered target (top-2): only the two allowed tokens ever appear, with renormalised mass."""
    logits = torch.log(P0.float())[None].repeat(3, 1)  # (N, V)
    params = SamplingParams(temperature=1.0, top_k=2)
    tree = TokenTree((0, 4, 1), (-1, 0, 0))  # a filtered-out draft first, then an allowed one
    gen = torch.Generator().manual_seed(3)
    c = Counter()
    for i in range(2000):
        if form == "coupled":  # unseeded, deterministic drafts: a fresh key per step
            a = accept("speculative", tree, logits, params, gen, position=7)
        elif form == "coupled-seeded":
            a = accept("speculative", tree, logits, dataclasses.replace(params, seed=i), gen, position=7)
        else:
            a = accept_speculative(tree, target_probs(logits, params), gen)
        c[([tree.tokens[i] for i in a.nodes[1:]] + [a.bonus])[0]] += 1
    z = float(P0[0] + P0[1])
    assert_fits(c, {0: float(P0[0]) / z, 1: float(P0[1]) / z}, "top-k")


def test_zero_draft_probability_is_an_error() -> None:
    q = torch.zeros(V, dtype=torch.float64)
    q[1] = 1.0
    tree = TokenTree((0, 2), (-1, 0), {0: q})
    with pytest.raises(ValueError, match="zero draft probability"):
        accept_speculative(tree, torch.full((2, V), 1.0 / V), torch.Generator().manual_seed(0))


# ---- typical acceptance -----------------------------------------------------
def test_typical_threshold() -> None:
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    ent = float(-(p[:5] * p[:5].log()).sum())
    eps, alpha = 0.09, 0.3
    thresh = min(eps, alpha * float(torch.exp(torch.tensor(-ent))))
    assert 0.05 < thresh < 0.1  # token 3 (0.1) passes, token 4 (0.05) fails
    logits = p.clamp_min(1e-30).log()[None].repeat(6, 1)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    # root -> 4 (fails) -> 0 ; root -> 3 (passes) -> 4 (fails) ; root -> 2 (passes) -> 1 (passes)
    tree = TokenTree((0, 4, 3, 2, 0, 4, 1), (-1, 0, 0, 0, 1, 2, 3))
    a = accept_typical(tree, logits[[0] * 7], params, gen, eps=eps, alpha=alpha)
    assert a.nodes == (0, 3, 6)
    assert a.bonus != 5  # bonus drawn from p: never the zero-probability token
    # the same tree with only rejected children keeps the root only
    tree2 = TokenTree((0, 4, 5), (-1, 0, 0))
    assert accept_typical(tree2, logits[:3], params, gen, eps=eps, alpha=alpha).nodes == (0,)
    # a huge alpha/eps raises the threshold above every probability: nothing accepted
    assert accept_typical(tree, logits[[0] * 7], params, gen, eps=1.0, alpha=100.0).nodes == (0,)
    # a zero threshold accepts anything with positive probability, longest path first
    assert len(accept_typical(tree, logits[[0] * 7], params, gen, eps=0.0, alpha=0.0).nodes) == 3
    # greedy params: the greedy rule
    assert accept_typical(tree, logits[[0] * 7], SamplingParams(), gen) == accept_greedy(tree, logits[[0] * 7])


def test_a_drafters_q_is_renormalised_before_the_ratio_test() -> None:
    """A drafter's q passes the engine's check when it sums to 1 within 1e-3; min(1, p / q) must use it renormalised,
    else a draft with p(x) = q(x) is rejected whenever the uniform lands in [p / (1.0009 q), 1), and the output's
    law moves by as much."""
    p = torch.tensor([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64) * 1.0009  # what the drafter reports
    seed = next(  # a generator whose first uniform is in that band (where the unnormalised q rejects)
        s
        for s in range(200_000)
        if float(torch.rand((), generator=torch.Generator().manual_seed(s), dtype=torch.float64)) > 1 / 1.0009
    )
    tree = TokenTree((0, 1), (-1, 0), {0: q})
    a = verify.accept_speculative(tree, p, torch.Generator().manual_seed(seed))
    assert a.nodes == (0, 1)
