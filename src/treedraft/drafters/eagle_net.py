"""The EAGLE draft network (Li et al. 2024, arXiv:2401.15077): config, fc + one decoder layer, persistence.

The drafter that runs it (dynamic trees, draft KV cache across steps) is :mod:`treedraft.drafters.eagle`.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from ..interfaces import TargetModel
from ..models.llama import Block, KVCache, LlamaConfig, RMSNorm, rope_frequencies

__all__ = ["EAGLE_JSON", "EAGLE_WEIGHTS", "EagleConfig", "EagleMismatchError", "EagleNet", "shipped_eagle_for"]

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
        from ..models.cache import atomic_write_text, save_tensors

        d = Path(d)
        d.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        if self.vocab_map is not None:
            sd["vocab_map"] = self.vocab_map.to(torch.int32).cpu()
        # the config goes first and comes back last: an interrupted save leaves no config (as MedusaHeads.save)
        (d / EAGLE_JSON).unlink(missing_ok=True)
        save_tensors(sd, d / EAGLE_WEIGHTS)
        atomic_write_text(d / EAGLE_JSON, json.dumps(asdict(self.config), indent=1))

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
        try:
            sd = load_file(str(d / EAGLE_WEIGHTS))
        except Exception as e:  # safetensors' own error: a torn or foreign file
            raise EagleMismatchError(
                f"{d / EAGLE_WEIGHTS} cannot be read ({type(e).__name__}: {e}); rewrite it with `treedraft "
                "train-eagle`, or restore it"
            ) from None
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
