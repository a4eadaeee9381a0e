"""Acceptance rules: pure functions of the target's outputs over a tree.

Each returns an :class:`Acceptance`: the accepted node indices (root first;
the root is always kept, it was already chosen by the target) and the bonus
token drawn from the target's own distribution at the last accepted node.

The lossless rule ("speculative") has two forms: :func:`accept_coupled` (every seeded request, and
unseeded ones whose drafts are deterministic) and :func:`accept_speculative`, recursive rejection sampling
(unseeded requests with sampled drafts); :func:`uses_coupling` picks. Plain steps go through
:func:`sample_token`, which draws with the same rule, so seeded speculative output equals seeded plain output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import SamplingParams, coupled_sample, draw, sample, target_probs, uniform
from .tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    nodes: tuple[int, ...]  # accepted node indices, root first
    bonus: int  # next token, from the target at nodes[-1]


def greedy_token(logits: Tensor) -> int:
    """argmax of one (V,) row: the first maximal index, as ``torch.argmax`` (NaN counts as maximal).

    A float32 CPU row goes through NumPy's vectorised argmax (~10 us for 49k logits on a Xeon, against
    ~120 us for ``torch.argmax``, which is not vectorised for float on CPU); any other row through torch.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())


def accept_greedy(tree: TokenTree, logits: Tensor) -> Acceptance:
    """Longest path whose every token equals the target's argmax at its parent. logits: (N, V).

    Only the rows on the accepted path are reduced (the argmax of every row is the step's largest
    cost after the forward for a 16-node tree).
    """
    kids = tree.children()
    node, path = 0, [0]
    while True:
        best = greedy_token(logits[node])
        nxt = next((c for c in kids[node] if tree.tokens[c] == best), None)
        if nxt is None:
            return Acceptance(tuple(path), best)
        node = nxt
        path.append(node)


def accept_speculative(tree: TokenTree, probs: Tensor, gen: torch.Generator) -> Acceptance:
    """Lossless multi-draft speculative sampling over a tree: recursive rejection sampling.

    The rule for several sampled siblings is recursive rejection sampling *without replacement*
    (Jeon et al. 2024, "Recursive Speculative Decoding", arXiv:2402.14160; Yang et al. 2024,
    "Multi-Candidate Speculative Decoding", arXiv:2401.06706). SpecInfer (Miao et al. 2023)
    verifies a token tree too, but treats sibling drafts as independent draws from q; here q is
    updated after every rejected sibling, which is what makes distinct draws lossless.

    probs: (N, V) target distributions (after temperature/top-k/top-p) at every node.
    At each node the children are tried in order. Sampled children (tree.child_q
    holds the draft distribution q they were drawn from one after another *without
    replacement*, see TokenTree) are each accepted with min(1, p(x)/q_i(x)), where q_i
    is q with the siblings already tried removed and renormalised; a rejection moves p
    to norm(max(p - q_i, 0)). Deterministic children (top-k, lookup) are a point-mass
    q, so acceptance is p(x) and a rejection zeroes x and renormalises.
    The emitted token is thus distributed exactly as p, level by level.
    Runs on the CPU (probs and q are moved there), like every draw from the CPU generator.
    """
    probs = probs.to(device="cpu")
    kids = tree.children()
    node, path = 0, [0]
    while True:
        p = probs[node].double().clone()
        q = tree.child_q.get(node)
        # renormalised: a drafter's q is checked to sum to 1 within 1e-3 (TokenTree), and min(1, p / q) with a q
        # summing to 1.001 would move the output's law by as much
        q = None if q is None else q.to(device="cpu", dtype=torch.float64)
        q = None if q is None else q / q.sum().clamp_min(1e-300)
        moved = False
        for c in kids[node]:
            x = tree.tokens[c]
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            if q is None:
                if u < float(p[x]):
                    moved = True
                else:
                    p[x] = 0.0
            else:
                qx = float(q[x])
                if qx <= 0.0:
                    raise ValueError(f"draft token {x} has zero draft probability; the drafter's q is inconsistent")
                if u < min(1.0, float(p[x]) / qx):
                    moved = True
                else:
                    p = (p - q).clamp_min(0.0)
                    q = q.clone()  # the next sibling was drawn from q without x
                    q[x] = 0.0
                    q = q / q.sum().clamp_min(1e-300)
            if moved:
                node = c
                path.append(c)
                break
            s = float(p.sum())
            if s <= 0.0:  # only reachable through float round-off: fall back to the target itself
                p = probs[node].double().clone()
                s = float(p.sum())
            p = p / s
        if not moved:
            return Acceptance(tuple(path), sample(p.float(), gen))


def accept_typical(
    tree: TokenTree, logits: Tensor, params: SamplingParams, gen: torch.Generator, eps: float = 0.09, alpha: float = 0.3
) -> Acceptance:
    """Medusa typical acceptance (Cai et al. 2024), lossy: accept x if p(x) > min(eps, alpha*exp(-H(p))).

    Picks the longest accepted path; the bonus token is sampled from p at its end.
    Under greedy params it is the greedy rule.

    Where this differs from Medusa's reference ``evaluate_posterior`` (typical branch) and the
    ``generate_candidates`` that follows it:
    - tie-break: among paths of the longest accepted length, the one whose last node comes first in
      tree order (parents before children, siblings in draft order) wins; Medusa takes the first
      candidate path in its own ``retrieve_indices`` order (argmax over accept lengths);
    - bonus token: sampled here from p (temperature, top-k, top-p) at the last accepted node;
      Medusa's default (``fast=True``) takes the argmax of the target's logits there;
    - p: here the same temperature/top-k/top-p distribution the other rules use, for both the
      threshold and the bonus; Medusa thresholds softmax(logits / temperature).
    """
    if params.greedy:
        return accept_greedy(tree, logits)
    probs = target_probs(logits, params)  # (N, V)
    ent = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # (N,)
    thresh = torch.minimum(torch.full_like(ent, eps), alpha * torch.exp(-ent))
    ok = [True] + [bool(probs[tree.parents[i], tree.tokens[i]] > thresh[tree.parents[i]]) for i in range(1, len(tree))]
    best: list[int] = [0]
    reach = [False] * len(tree)
    reach[0] = True
    for i in range(1, len(tree)):  # parents precede children
        reach[i] = reach[tree.parents[i]] and ok[i]
        if reach[i]:
            path = tree.path_to(i)
            if len(path) > len(best):
                best = path
    return Acceptance(tuple(best), sample(probs[best[-1]], gen))


def accept_coupled(tree: TokenTree, logits: Tensor, params: SamplingParams, seed: int, position: int) -> Acceptance:
    """Lossless tree verification by coupled draws: greedy verification of the target's own seeded samples.

    The token at absolute position t is :func:`treedraft.sampling.coupled_sample` (seed, t): an exact draw
    from the target's p_t that depends on nothing but (seed, t, p_t). Walk from the root (whose next token
    sits at ``position``): at a node of depth d, draw the target's token for position ``position`` + d; go
    to the child holding it, or emit it as the bonus token and stop. Every emitted token is therefore the
    one plain seeded decoding would emit, whatever the tree: the output is a function of (seed, prompt),
    and is distributed exactly as the target's (Leviathan et al. 2023 for the lossless argument; only
    the path walked is drawn, one Gumbel-max pass per emitted token). The drafts' q (``child_q``) is
    not used: for deterministic drafts a node's children are taken with probability p(children), as under
    recursive rejection sampling; for sampled drafts that is less than rejection sampling would accept.
    logits: (N, V).
    """
    kids = tree.children()
    node, path = 0, [0]
    while True:
        x = coupled_sample(logits[node], params, seed, position + len(path) - 1)
        nxt = next((c for c in kids[node] if tree.tokens[c] == x), None)
        if nxt is None:
            return Acceptance(tuple(path), x)
        node = nxt
        path.append(node)


RULES = ("greedy", "speculative", "typical")


def uses_coupling(rule: str, params: SamplingParams, tree: TokenTree | None = None) -> bool:
    """Whether a sampled request's step is verified (or drawn, ``tree`` None) by coupled draws.

    Rule "speculative" only (typical acceptance keeps its own draws). A seeded request always: its text must
    not depend on the drafts, hence not on its batch-mates (the suffix index is shared). An unseeded one
    unless the tree has sampled drafts (``child_q``): for deterministic drafts both forms accept exactly as
    often (measured: benchmarks/coupled_acceptance.py) and the coupled one draws less (one row's
    distribution per emitted token instead of every node's), but for sampled drafts rejection sampling,
    which uses q, accepts more.
    """
    if params.greedy or rule != "speculative":
        return False
    return params.seed is not None or tree is None or not tree.child_q


def coupling_seed(params: SamplingParams, gen: torch.Generator) -> int:
    """The key of a step's coupled draws: the request's seed, or (unseeded) a fresh one from its generator."""
    if params.seed is not None:
        return int(params.seed)
    return int(torch.randint(0, 2**63 - 1, (), generator=gen))


def sample_token(
    rule: str, logits: Tensor, params: SamplingParams, gen: torch.Generator, position: int, seed: int | None = None
) -> int:
    """A plain step's token (a tree with the root only): argmax, coupled draw or a draw from ``gen``. logits: (V,).

    ``position``: the token's index in prompt + output (the key of a seeded draw). ``seed``: the request's coupling
    seed (``Request.coupling``), else one from :func:`coupling_seed`.
    """
    if params.greedy:
        return greedy_token(logits)
    if uses_coupling(rule, params):
        return coupled_sample(logits, params, coupling_seed(params, gen) if seed is None else seed, position)
    return draw(logits, params, uniform(gen))


def accept(
    rule: str,
    tree: TokenTree,
    logits: Tensor,
    params: SamplingParams,
    gen: torch.Generator,
    position: int | None = None,
    seed: int | None = None,
) -> Acceptance:
    """Dispatch by rule name. 'greedy' needs temperature 0; 'speculative' is lossless sampling.

    ``position``: index in prompt + output of the token the root's row predicts (``len(tokens)`` with the
    root last); needed by the coupled form of 'speculative' (:func:`uses_coupling`). ``seed``: the key of its
    coupled draws (the request's ``coupling``), else one from :func:`coupling_seed`.
    """
    if params.greedy or rule == "greedy":
        if rule == "greedy" and not params.greedy:
            raise ValueError("acceptance rule 'greedy' needs temperature 0; use 'speculative' or 'typical'")
        return accept_greedy(tree, logits)
    if rule == "speculative":
        if uses_coupling(rule, params, tree):
            if position is None:
                raise ValueError("the coupled speculative rule needs the root's position (accept(..., position=))")
            key = coupling_seed(params, gen) if seed is None else seed
            return accept_coupled(tree, logits, params, key, position)
        return accept_speculative(tree, target_probs(logits, params), gen)
    if rule == "typical":
        return accept_typical(tree, logits, params, gen)
    raise ValueError(f"unknown acceptance rule {rule!r}; choose one of {RULES}")
