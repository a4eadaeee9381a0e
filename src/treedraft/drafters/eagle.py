"""EAGLE feature drafter (Li et al. 2024, arXiv:2401.15077) with EAGLE-2 dynamic trees (arXiv:2406.16858).

One Llama decoder layer runs autoregressively over *pairs* (f_j, x_{j+1}): the target's final-norm
hidden state at position j (the lm_head input) and the token that followed it. Its input is
fc([embed(x_{j+1}) ; f_j]) (2H -> H); its output predicts f_{j+1}, which the target's frozen lm_head
turns into a distribution over x_{j+2}. Deeper drafts feed the predicted feature back with the drafted
token. The layer keeps its own KV cache of pairs whose feature came from the target (never from a
draft); each step appends the features of the tokens just committed and drops the tree.

The tree (EAGLE-2): depth 1 = top-k children of the root; at every later depth the k frontier nodes
with the highest cumulative draft log-probability are expanded (one batched draft forward), each
into its top-k children; finally all drafted nodes are reranked by cumulative log-probability and
the best N kept (a child never outranks its parent, so the kept set is a trie). Children are chosen
deterministically (top-k), so the tree carries no ``child_q`` and the lossless rule verifies them as
point masses (verify.accept_speculative).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..interfaces import DraftContext, TargetModel, request_twin
from ..tree import TokenTree
from .eagle_native import fast_drafting
from .eagle_net import EAGLE_JSON, EAGLE_WEIGHTS, EagleConfig, EagleMismatchError, EagleNet, shipped_eagle_for
from .eagle_tree import RankAcceptance, TreeCalibration, coupled_pick, grow_tree, prior_values

__all__ = [
    "EAGLE_JSON",
    "EAGLE_WEIGHTS",
    "EagleConfig",
    "EagleDrafter",
    "EagleMismatchError",
    "EagleNet",
    "fast_drafting",
    "shipped_eagle_for",
]


class EagleDrafter:
    """Dynamic-tree drafter over an :class:`EagleNet`, with a draft KV cache kept across steps."""

    name = "eagle"

    def __init__(
        self,
        net: EagleNet,
        max_len: int = 4096,
        depth: int | None = None,
        topk: int | None = None,
        nodes: int | None = None,
        project=None,
        project_vocab: Tensor | None = None,
        native=None,
        latency: dict[int, float] | None = None,
        draft_step_seconds: float | None = None,
    ) -> None:
        """project: optional (rows, H) -> (rows, V'') logits used instead of the net's float projection
        (see :func:`fast_drafting`); project_vocab: the token id of each of its V'' columns (None: all V ids);
        native: a :class:`~.eagle_native.NativeDraftStep` running each draft depth as one native call;
        latency: the target's forward seconds per row count: when given, the tree keeps the N nodes that
        maximise expected tokens per second (:mod:`.eagle_tree`) instead of the whole budget, and stops
        drafting deeper when no frontier node can pay for another draft step (draft_step_seconds, default
        a tenth of the one-row forward)."""
        from .eagle_tree import LatencyCurve

        c = net.config
        self.net = net
        self.project = project
        self.native = native
        self.vm = net.vocab_map if project is None and native is None else project_vocab
        self._vm_np = None if self.vm is None else self.vm.cpu().numpy()
        self.depth = c.depth if depth is None else depth  # (0 was taken for "the config's": refused now)
        self.topk = c.topk if topk is None else topk
        self.nodes = c.nodes if nodes is None else nodes
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"depth and topk must be >= 1, got {self.depth}, {self.topk}")
        self.curve = None if latency is None else LatencyCurve(latency)
        if draft_step_seconds is None and self.curve is not None:
            draft_step_seconds = float(self.curve(1)) / 10
        self.step_seconds = draft_step_seconds or 0.0
        self.max_len = max_len
        self.draft_weights = "q8"  # the format of the native draft layer's linears (for_target; cached costs key)
        self.last_expected = 1.0  # 1 + the summed draft values of the last tree (EAGLE-2's E[accepted + bonus])
        self.draft_costs: tuple[float, float] = (0.0, 0.0)  # seconds: (commit + depth 1, each further depth)
        # what verified trees taught (calibration, back-off) and the per-rank acceptance the hybrid prices nodes by
        self.cal = TreeCalibration(
            RankAcceptance(self.nodes or self.depth * self.topk, prior_values(c, self.nodes or 16))
        )
        self.cache = net.new_cache(max_len + self.depth * self.topk + 1)
        self.reset()

    def reset(self) -> None:
        """Forget the committed pairs (a new sequence starts)."""
        # features of skipped steps not yet in the cache: (f_at .., at, x_at) (the token guards against another sequence)
        self._pending: tuple[Tensor, int, int] | None = None
        self.cal.reset()  # the last tree's outcome will not be seen
        self.cache.length = 0
        self.base = 0  # pair index held in cache slot 0
        self.tokens: list[int] = []  # tokens x_0 .. x_r of the committed pairs (pair j uses x_{j+1})

    def fresh(self) -> EagleDrafter:
        """A copy that has learned nothing yet: its per-rank acceptance back at the prior and a new calibration, its own
        draft KV cache; the same net, native step and measured costs (``treedraft bench --fresh-drafter-state``, which
        also reaches EAGLE inside a hybrid through :func:`.hybrid.fresh_copy`)."""
        r = self.cal.ranks
        cal = TreeCalibration(None if r is None else RankAcceptance(r.size, r.prior))
        return request_twin(self, cache=self.net.new_cache(self.cache.max_len), cal=cal)

    def for_request(self) -> EagleDrafter:
        """A twin for one request: the same net, native step and per-rank acceptance, its own draft KV cache (from
        this calibration)."""
        return request_twin(self, cache=self.net.new_cache(self.cache.max_len), cal=self.cal.fork())

    @property
    def committed(self) -> int:
        """Pairs (f_j, x_{j+1}) in the draft cache, counted from pair 0."""
        return self.base + self.cache.length

    def _run(self, feats: Tensor, toks: Tensor, pos: Tensor, start: int, mask: Tensor | None, last_only: bool):
        """One draft forward of e rows at cache slots [start, start + e) -> (logits (R, V') float32, feats (e, H)).

        R = 1 (the last row) when ``last_only`` else e. mask (e, start + e) bool, None = causal."""
        if self.native is not None:
            rows = torch.tensor([toks.shape[0] - 1]) if last_only else None
            logits, out = self.native(feats.float().contiguous(), toks, pos, self.cache, start, mask, rows)
        else:
            out = self.net(feats[None], toks[None], pos, self.cache, start, mask)[0]  # (e, H)
            logits = self._logits(out[-1:] if last_only else out)
        return logits.float(), out

    def _new_feats(self, ctx: DraftContext) -> tuple[Tensor, int]:
        """(n, H) features f_{first} .. f_{r-1} of the pairs committed since the last draft, and ``first``
        (rows held back by skipped steps first, when they join up)."""
        r = len(ctx.tokens) - 1  # the root's position
        feats = ctx.accepted_hidden if ctx.accepted_hidden is not None else ctx.hidden
        if feats is None:
            raise ValueError("the eagle drafter needs the target's hidden states; this target does not provide them")
        feats = feats.reshape(-1, feats.shape[-1])[-r:]  # (n, H): f_{r-n} .. f_{r-1}
        first = r - feats.shape[0]
        if self._pending is not None:
            held, at, tok = self._pending
            self._pending = None
            if at + held.shape[0] == first and ctx.tokens[at] == tok:
                feats, first = torch.cat([held, feats]), at
        return feats, first

    @torch.inference_mode()
    def _commit(self, ctx: DraftContext) -> tuple[Tensor, Tensor]:
        """Feed the pairs committed since the last step; returns the depth-1 draft logits (1, V') and the root's
        predicted feature f_r (H,)."""
        r = len(ctx.tokens) - 1
        feats, first = self._new_feats(ctx)
        same = self.committed == first and self.tokens[: first + 1] == list(ctx.tokens[: first + 1])
        if not same:
            self.reset()
            self.base = first
        slot = self.cache.length
        if slot + feats.shape[0] > self.max_len:
            raise ValueError(f"eagle drafter: context {r} exceeds its cache of {self.max_len} pairs")
        dev = self.net.emb_norm.weight.device
        toks = torch.tensor(ctx.tokens[first + 1 : r + 1], device=dev)  # (n,) x_{j+1}
        pos = torch.arange(first, r, device=dev)
        logits, out = self._run(feats.to(dev), toks, pos, slot, None, last_only=True)
        self.cache.length = slot + feats.shape[0]
        self.tokens = list(ctx.tokens[: r + 1])
        return logits, out[-1]

    @property
    def calibration(self) -> float:
        """Accepted draft tokens per unit of expected draft value over recent trees (:class:`TreeCalibration`)."""
        return self.cal.factor

    def node_values(self, max_depth: int) -> list[float] | None:
        """Expected acceptance of the tree's nodes in rank order (best cumulative draft log-prob first), as
        measured on this drafter's recent verified trees (prior: the held-out per-depth top-1 as a chain);
        what the hybrid drafter prices this member's first k nodes by. ``max_depth`` caps how many ranks."""
        ranks = self.cal.ranks
        n = ranks.size if max_depth >= self.depth else min(ranks.size, max_depth * self.topk)
        return ranks.values()[:n].tolist()

    def draft_cost_for(self, nodes: int) -> float:
        """Seconds a propose of ``nodes`` draft nodes costs (what the hybrid drafter weighs): the commit with
        depth 1, then one draft forward per further depth a tree of that size can reach (at most ``depth``)."""
        return self._drafting_seconds(max(1, min(nodes, self.depth)))

    def _drafting_seconds(self, forwards: int) -> float:
        """Seconds of a propose that ran ``forwards`` draft forwards (the commit is the first): the measured
        ``draft_costs`` when set (registry.eagle_draft_costs_on_curve), else ``forwards`` x draft_step_seconds."""
        first, more = self.draft_costs
        if first or more:
            return first + more * (forwards - 1)
        return forwards * self.step_seconds

    def idle(self, ctx: DraftContext) -> None:
        """This step drafts nothing (a hybrid did not ask): learn the last tree's outcome and hold the
        committed features until the next propose feeds them in one draft forward."""
        self.cal.learn(ctx.tokens)
        feats, first = self._new_feats(ctx)
        self._pending = (feats, first, ctx.tokens[first])
        self.last_expected = 1.0

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> TokenTree:
        """An EAGLE-2 tree of at most ``ctx.max_nodes`` nodes (root included) and ``ctx.max_depth`` depth."""
        budget = ctx.max_nodes - 1 if not self.nodes else min(self.nodes, ctx.max_nodes - 1)
        depth = min(self.depth, ctx.max_depth, max(1, budget))  # a tree of N nodes is at most N deep
        if self.cal.skip_step(budget >= 1 and depth >= 1):  # back-off: hold the features for the next commit
            self.idle(ctx)
            return TokenTree((ctx.root,), (-1,))
        self.cal.learn(ctx.tokens)
        logits, f_root = self._commit(ctx)
        if budget < 1 or depth < 1:
            self.last_expected = 1.0
            return TokenTree((ctx.root,), (-1,))
        r, base = len(ctx.tokens) - 1, self.cache.length
        feat_of: dict[int, Tensor] = {0: f_root}  # a node's predicted feature, once expanded (the root's: f_r)

        def expand(nodes: list[int], toks: list[int], parents: list[int], depths: list[int], start: int, mask: Tensor):
            # each expanded node feeds its parent's predicted feature with its own token, at pair position r + d - 1
            feats = torch.stack([feat_of[p] for p in parents])  # (e, H)
            dev = f_root.device
            pos = torch.tensor([r + d - 1 for d in depths], dtype=torch.long, device=dev)
            logits, out = self._run(feats, torch.tensor(toks, device=dev), pos, start, mask.to(dev), last_only=False)
            for row, i in enumerate(nodes):
                feat_of[i] = out[row]
            return logits

        tree, self.last_expected, probs = grow_tree(
            ctx.root,
            logits,
            expand,
            base=base,
            budget=budget,
            depth=depth,
            topk=self.topk,
            curve=None if self.curve is None else self.curve.at(len(ctx.tokens)),  # this context's row costs
            cal=self.cal,
            drafting_seconds=self._drafting_seconds,  # an estimate (not timed): the tree is a function of the inputs
            vocab=self._vm_np,
            pick=coupled_pick(ctx, self.topk, self._vm_np),  # sampled and coupled: the target's noise picks
        )
        self.cache.length = base  # drafts never stay in the cache
        self.cal.drafted(self.last_expected - 1.0, r, ctx.root, tree, probs)
        return tree

    def _logits(self, f: Tensor) -> Tensor:
        """(rows, H) predicted features -> (rows, V') float32 draft scores."""
        if self.project is not None:
            return self.project(f.to(self.net.lm_weight.dtype)).float()
        return self.net.logits(f)

    @staticmethod
    def for_target(
        target: TargetModel,
        d: str | Path,
        model_name: str | None = None,
        latency: dict[int, float] | str | None = "measured",
        draft_weights: str = "q8",
    ) -> EagleDrafter:
        """Load the drafter in ``d`` for ``target`` (EagleMismatchError if trained for another model); on a
        native target it drafts through one native call per depth and, with latency "measured", sizes its
        trees by this machine's forward latency curve (:func:`treedraft.scheduler.measured_latency`);
        None keeps the whole node budget; a dict is used as the curve (see :class:`EagleDrafter`). draft_weights:
        the format of the draft layer's native linears (:func:`fast_drafting`)."""
        from .eagle_native import native_draft_step

        net = EagleNet.load(d, target, model_name)
        net, project, vocab = fast_drafting(net, target, draft_weights)
        native = native_draft_step(net, project) if project is not None else None
        if latency == "measured":
            from ..scheduler import measured_latency

            latency = measured_latency(target) if native is not None else None
        elif isinstance(latency, str):
            raise ValueError(f"latency must be 'measured', None or a dict of row count -> seconds, got {latency!r}")
        max_len = getattr(target, "max_seq_len", 4096) or 4096
        d = EagleDrafter(net, max_len=max_len, project=project, project_vocab=vocab, native=native, latency=latency)
        d.draft_weights = draft_weights
        return d
