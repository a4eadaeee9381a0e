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

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from ..interfaces import DraftContext, TargetModel
from ..models.llama import Block, KVCache, LlamaConfig, RMSNorm, rope_frequencies
from ..tree import TokenTree

EAGLE_JSON = "eagle.json"
EAGLE_WEIGHTS = "eagle.safetensors"
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


class EagleMismatchError(ValueError):
    """An EAGLE drafter trained for another target model (or a malformed drafter directory)."""


@dataclass(frozen=True)
class EagleConfig:
    """Shape of the draft layer (the target's, one layer) and the default tree."""

    base_model: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    draft_vocab: int = 0  # >0: the lm_head scores only the first N ids of vocab_map (frequency-ranked)
    depth: int = 6  # tree depth (draft forwards per step)
    topk: int = 8  # children per expanded node and nodes expanded per depth
    nodes: int = 0  # draft nodes kept per tree (root excluded); 0 = the engine's budget
    extra: dict = field(default_factory=dict)  # training facts (data, loss, per-depth accuracy)

    @staticmethod
    def for_target(target: TargetModel, base_model: str, **kw) -> EagleConfig:
        """The config of a draft layer shaped like one layer of ``target`` (a models/llama Transformer)."""
        c = getattr(target, "config", None)
        if not isinstance(c, LlamaConfig):
            raise EagleMismatchError(
                f"an EAGLE drafter copies the target's layer shape from a Llama config; {type(target).__name__} has none"
            )
        return EagleConfig(
            base_model=base_model,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            intermediate_size=c.intermediate_size,
            rope_theta=c.rope_theta,
            rms_eps=c.rms_eps,
            **kw,
        )

    def llama(self) -> LlamaConfig:
        """The one-layer LlamaConfig of the draft decoder layer."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            rope_theta=self.rope_theta,
            rms_eps=self.rms_eps,
            head_dim_override=self.head_dim,
        )

    @staticmethod
    def from_json(d: dict, where: Path) -> EagleConfig:
        """From an eagle.json dict; unknown or missing keys raise EagleMismatchError naming them."""
        known = {f.name for f in fields(EagleConfig)}
        required = {f.name for f in fields(EagleConfig) if f.default is f.default_factory is MISSING}
        if not isinstance(d, dict) or set(d) - known or required - set(d):
            bad = sorted(set(d) - known) if isinstance(d, dict) else []
            miss = sorted(required - set(d)) if isinstance(d, dict) else sorted(required)
            raise EagleMismatchError(
                f"{where} does not match this version of treedraft (unknown keys {bad}, missing keys {miss}); "
                "retrain with `treedraft train-eagle`"
            )
        return EagleConfig(**d)


class EagleNet(nn.Module):
    """fc + one decoder layer; ``forward(feat, tok, pos)`` -> predicted next features (B, T, H)."""

    def __init__(
        self, cfg: EagleConfig, embed_weight: Tensor, lm_head_weight: Tensor, vocab_map: Tensor | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        # both inputs RMS-normalised first (as EAGLE-3 does): the target's final-norm features are ~17x the
        # size of its token embeddings, which otherwise starves the token path (measured: top-1 0.09 vs ...)
        self.emb_norm = RMSNorm(H, cfg.rms_eps)
        self.feat_norm = RMSNorm(H, cfg.rms_eps)
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = Block(cfg.llama(), 0)
        self.register_buffer("inv_freq", rope_frequencies(cfg.llama()), persistent=False)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)  # (V, H), frozen
        self.set_vocab(lm_head_weight, vocab_map)

    def set_vocab(self, lm_head_weight: Tensor, vocab_map: Tensor | None) -> None:
        """Attach the target's frozen lm_head, restricted to the first ``draft_vocab`` ids of vocab_map."""
        n = self.config.draft_vocab
        if n:
            if vocab_map is None or len(vocab_map) < n:
                raise EagleMismatchError(f"draft_vocab={n} needs a vocab_map of at least {n} token ids")
            vocab_map = vocab_map[:n].long()
        else:
            vocab_map = None
        self.register_buffer("vocab_map", vocab_map, persistent=False)  # (V',) token ids, None = all
        w = lm_head_weight.detach()
        w = w if vocab_map is None else w[vocab_map.to(w.device)]
        self.register_buffer("lm_weight", w.float().contiguous(), persistent=False)  # (V', H)

    def forward(
        self, feat: Tensor, tok: Tensor, pos: Tensor, cache: KVCache | None = None, start: int = 0, mask=None
    ) -> Tensor:
        """feat (B, T, H) features f_j, tok (B, T) tokens x_{j+1}, pos (T,) or (B, T) -> (B, T, H) f_{j+1}.

        cache/start: keys/values go to slots [start, start+T); mask (T, start+T) or (B, 1, T, start+T)
        bool, True = may attend (None: causal)."""
        dt = self.emb_norm.weight.dtype
        e = self.embed_weight[tok].to(dt)  # (B, T, H)
        x = self.fc(torch.cat([self.emb_norm(e), self.feat_norm(feat.to(dt))], dim=-1))
        if pos.dim() == 1:
            pos = pos[None].expand(x.shape[0], -1)
        ang = pos[..., None].float() * self.inv_freq  # (B, T, hd/2)
        ang = torch.cat((ang, ang), dim=-1)[:, None]  # (B, 1, T, hd)
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        if mask is None and cache is not None and start > 0:
            T = x.shape[1]
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)[None, None]
        return self.layer(x, ang.cos().to(dt), ang.sin().to(dt), mask, cache, start)

    def logits(self, f: Tensor) -> Tensor:
        """(..., H) features -> (..., V') float32 scores over the draft vocabulary."""
        return f.float() @ self.lm_weight.T

    def new_cache(self, max_len: int) -> KVCache:
        """An empty one-layer KV cache for ``max_len`` pairs."""
        c, p = self.config, self.emb_norm.weight
        return KVCache(1, 1, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device)

    # ---- persistence ---------------------------------------------------
    def save(self, d: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write eagle.safetensors (weights in ``dtype`` if given) + eagle.json into directory ``d``."""
        from safetensors.torch import save_file

        d = Path(d)
        d.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        if self.vocab_map is not None:
            sd["vocab_map"] = self.vocab_map.to(torch.int32).cpu()
        save_file(sd, str(d / EAGLE_WEIGHTS))
        (d / EAGLE_JSON).write_text(json.dumps(asdict(self.config), indent=1))

    @staticmethod
    def load(d: str | Path, target: TargetModel, base_model: str | None = None) -> EagleNet:
        """Load a drafter directory for ``target``; EagleMismatchError when it was trained for another model."""
        from safetensors.torch import load_file

        d = Path(d)
        if not (d / EAGLE_JSON).is_file():
            raise FileNotFoundError(f"{d}: no {EAGLE_JSON}; expected a directory written by `treedraft train-eagle`")
        try:
            cfg = EagleConfig.from_json(json.loads((d / EAGLE_JSON).read_text()), d / EAGLE_JSON)
        except json.JSONDecodeError as e:
            raise EagleMismatchError(f"{d / EAGLE_JSON} is not valid JSON ({e})") from e
        problems = []
        if base_model and cfg.base_model != base_model:
            problems.append(f"base model {cfg.base_model!r} != {base_model!r}")
        if cfg.hidden_size != target.hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            problems.append(f"vocab size {cfg.vocab_size} != {target.vocab_size}")
        if problems:
            raise EagleMismatchError(
                f"the EAGLE drafter in {d} was trained for another model: {'; '.join(problems)}. "
                "Train one for this model with `treedraft train-eagle --model ...`."
            )
        emb, lm = target.input_embedding_weight(), target.output_projection_weight()
        if emb is None or lm is None:
            raise ValueError(
                f"the eagle drafter needs the target's embedding and lm_head; {type(target).__name__} has none"
            )
        sd = load_file(str(d / EAGLE_WEIGHTS))
        vm = sd.pop("vocab_map", None)
        if vm is not None and (int(vm.min()) < 0 or int(vm.max()) >= cfg.vocab_size):
            raise EagleMismatchError(f"{d / EAGLE_WEIGHTS}: vocab_map has ids outside [0, {cfg.vocab_size})")
        net = EagleNet(cfg, emb, lm, None if vm is None else vm.long())
        want = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in sd.items()}
        if want != got:
            diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            raise EagleMismatchError(
                f"{d / EAGLE_WEIGHTS} does not match {d / EAGLE_JSON}: tensors {diff[:4]} differ "
                f"(file {[got.get(k) for k in diff[:4]]}, config {[want.get(k) for k in diff[:4]]})"
            )
        net.load_state_dict({k: v.float() for k, v in sd.items()})
        return net.to(lm.device).eval().requires_grad_(False)


def shipped_eagle_for(model_name: str) -> Path | None:
    """Directory of the EAGLE drafter shipped in the package for a registry model name, if any."""
    d = HEADS_DIR / model_name
    return d if (d / EAGLE_JSON).is_file() else None


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
    ) -> None:
        """project: optional (rows, H) -> (rows, V'') logits used instead of the net's float projection
        (see :func:`fast_drafting`); project_vocab: the token id of each of its V'' columns (None: all V ids)."""
        c = net.config
        self.net = net
        self.project = project
        self.vm = net.vocab_map if project is None else project_vocab
        self.depth = depth or c.depth
        self.topk = topk or c.topk
        self.nodes = c.nodes if nodes is None else nodes
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"depth and topk must be >= 1, got {self.depth}, {self.topk}")
        self.max_len = max_len
        self.cache = net.new_cache(max_len + self.depth * self.topk + 1)
        self.reset()

    def reset(self) -> None:
        """Forget the committed pairs (a new sequence starts)."""
        self.cache.length = 0
        self.base = 0  # pair index held in cache slot 0
        self.tokens: list[int] = []  # tokens x_0 .. x_r of the committed pairs (pair j uses x_{j+1})

    @property
    def committed(self) -> int:
        """Pairs (f_j, x_{j+1}) in the draft cache, counted from pair 0."""
        return self.base + self.cache.length

    @torch.inference_mode()
    def _commit(self, ctx: DraftContext) -> Tensor:
        """Feed the pairs committed since the last step; returns the root's predicted feature f_r (H,)."""
        r = len(ctx.tokens) - 1  # the root's position
        feats = ctx.accepted_hidden if ctx.accepted_hidden is not None else ctx.hidden
        if feats is None:
            raise ValueError("the eagle drafter needs the target's hidden states; this target does not provide them")
        feats = feats.reshape(-1, feats.shape[-1])[-r:]  # (n, H): f_{r-n} .. f_{r-1}
        first = r - feats.shape[0]
        same = self.committed == first and self.tokens[: first + 1] == list(ctx.tokens[: first + 1])
        if not same:
            self.reset()
            self.base = first
        slot = self.cache.length
        if slot + feats.shape[0] > self.max_len:
            raise ValueError(f"eagle drafter: context {r} exceeds its cache of {self.max_len} pairs")
        dev = self.net.emb_norm.weight.device
        toks = torch.tensor(ctx.tokens[first + 1 : r + 1], device=dev)[None]  # (1, n) x_{j+1}
        pos = torch.arange(first, r, device=dev)
        out = self.net(feats[None].to(dev), toks, pos, self.cache, slot)  # (1, n, H)
        self.cache.length = slot + feats.shape[0]
        self.tokens = list(ctx.tokens[: r + 1])
        return out[0, -1]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> TokenTree:
        """An EAGLE-2 tree of at most ``ctx.max_nodes`` nodes (root included) and ``ctx.max_depth`` depth."""
        f_root = self._commit(ctx)
        budget = ctx.max_nodes - 1 if not self.nodes else min(self.nodes, ctx.max_nodes - 1)
        depth = min(self.depth, ctx.max_depth)
        if budget < 1 or depth < 1:
            return TokenTree((ctx.root,), (-1,))
        net, k, r = self.net, self.topk, len(ctx.tokens) - 1
        # candidate nodes (root = 0): token, parent, cumulative log-prob, depth; slot = draft cache slot if expanded
        tok, par, score, dep = [ctx.root], [-1], [0.0], [0]
        slot_of: dict[int, int] = {}
        feat_of: dict[int, Tensor] = {0: f_root}
        base = self.cache.length
        frontier = self._children([0], self._logits(f_root[None]), k, tok, par, score, dep)
        dev = f_root.device
        for d in range(1, depth):
            expand = sorted(frontier, key=lambda i: -score[i])[:k]
            start = base + len(slot_of)
            # each expanded node attends to the committed pairs, its expanded ancestors and itself
            mask = torch.zeros(len(expand), start + len(expand), dtype=torch.bool, device=dev)
            mask[:, :base] = True
            for row, i in enumerate(expand):
                mask[row, start + row] = True
                a = par[i]
                while a > 0:
                    mask[row, slot_of[a]] = True
                    a = par[a]
            feats = torch.stack([feat_of[par[i]] for i in expand])[None]  # (1, e, H)
            toks = torch.tensor([tok[i] for i in expand], device=dev)[None]
            pos = torch.tensor([r + d - 1] * len(expand), device=dev)
            out = net(feats, toks, pos, self.cache, start, mask)[0]  # (e, H)
            for row, i in enumerate(expand):
                slot_of[i], feat_of[i] = start + row, out[row]
            frontier = self._children(expand, self._logits(out), k, tok, par, score, dep)
        self.cache.length = base  # drafts never stay in the cache
        # rerank: the best `budget` nodes by cumulative log-prob; ties keep parents (shallower, earlier) first
        keep = sorted(range(1, len(tok)), key=lambda i: (-score[i], dep[i], i))[:budget]
        new = {0: 0}
        tokens, parents = [ctx.root], [-1]
        for i in keep:
            new[i] = len(tokens)
            tokens.append(tok[i])
            parents.append(new[par[i]])
        return TokenTree(tuple(tokens), tuple(parents))

    def _logits(self, f: Tensor) -> Tensor:
        """(rows, H) predicted features -> (rows, V') float32 draft scores."""
        if self.project is not None:
            return self.project(f.to(self.net.lm_weight.dtype)).float()
        return self.net.logits(f)

    def _children(self, nodes: list[int], logits: Tensor, k: int, tok, par, score, dep) -> list[int]:
        """Add the top-k children of each of ``nodes`` (logits (len(nodes), V') rows); return their indices."""
        # top-k of the log-softmax = top-k of the logits minus the row's logsumexp: one topk call per depth
        v, ids = logits.topk(min(k, logits.shape[-1]), -1)  # (e, k)
        v = v - torch.logsumexp(logits, -1, keepdim=True)
        if self.vm is not None:
            ids = self.vm[ids]
        out = []
        for i, vals, ts in zip(nodes, v.tolist(), ids.tolist()):
            for val, t in zip(vals, ts):
                out.append(len(tok))
                tok.append(int(t))
                par.append(i)
                score.append(score[i] + val)
                dep.append(dep[i] + 1)
        return out

    @staticmethod
    def for_target(target: TargetModel, d: str | Path, model_name: str | None = None) -> EagleDrafter:
        """Load the drafter in ``d`` for ``target`` (EagleMismatchError if trained for another model)."""
        net = EagleNet.load(d, target, model_name)
        net, project, vocab = fast_drafting(net, target)
        max_len = getattr(target, "max_seq_len", 4096) or 4096
        return EagleDrafter(net, max_len=max_len, project=project, project_vocab=vocab)


def fast_drafting(net: EagleNet, target: TargetModel) -> tuple[EagleNet, object, Tensor | None]:
    """(net, project, project_vocab) for drafting: on a target served by the native quantized kernels, the
    draft layer's linears and its draft-vocabulary head become native group-32 int8 (q8, round-to-nearest);
    else the net as it is, projecting with the target's quantized lm_head if it has one.

    Measured on the int4 Skylake target (one draft depth, 1-4 rows, a loaded 2-core machine: ratios only):
    the full 49k-token int4 lm_head 24-29 ms, the 4k-token draft-vocabulary head in fp32 7-14 ms and as
    q8 1.3-2.5 ms; the fp32 draft layer 22-45 ms, q8 14-18 ms. A net with the full vocabulary
    (draft_vocab 0) keeps projecting through the target's own quantized lm_head.
    """
    import copy

    from ..models.llama import Linear
    from ..models.quant import NativeLinear, QuantLinear, native_kernels, quantize_q8_rtn, swap_linears

    lm = getattr(target, "lm_head", None)
    lm = lm if isinstance(lm, QuantLinear) else None
    natives = native_kernels()
    if lm is None or natives is None:
        return net, lm, None
    fast = copy.deepcopy(net)
    qw = {
        n: quantize_q8_rtn(m.weight.detach())
        for n, m in fast.named_modules()
        if isinstance(m, (Linear, nn.Linear)) and m.in_features % 32 == 0
    }
    swap_linears(fast, qw, {"q8": "native"}, natives)
    fast.layer.attn.exact_attention = False  # the draft layer keeps SDPA (its tree masks over the draft cache)
    if net.vocab_map is None:
        return fast, lm, None
    return fast, NativeLinear("q8", quantize_q8_rtn(net.lm_weight).parts, None, natives), net.vocab_map
