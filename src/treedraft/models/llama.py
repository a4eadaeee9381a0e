"""Compact Llama-family transformer (Llama 2/3, SmolLM2, Qwen2/Mistral-style GQA), and Gemma 3's variant of it.

Gemma 3 (Gemma Team 2025, arXiv:2503.19786) is the same decoder with: input embeddings scaled by sqrt(hidden),
RMSNorm on each head's q and k before RoPE, a second RMSNorm on the attention and FFN outputs ("sandwich"
norms), a GELU (tanh) gate, and local layers (5 of every 6) that attend to the last ``sliding_window`` positions
with their own RoPE base. :class:`LlamaConfig`'s fields for these default to Llama's behaviour.

In the style of gpt-fast: a plain ``nn.Module`` whose only state besides weights
is the :class:`KVCache` the caller hands to :meth:`Transformer.forward`.
Positions and the attention mask are explicit arguments, so a tree of draft
tokens is just another batch of tokens with its own positions and mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import watch
from .bf16 import bf16_gemm_available, linear_bf16, pack_bf16  # noqa: F401  (re-exported: drafters use them)
from .kvcache import KVCache, Segment
from .matmul import (  # noqa: F401  (re-exported: callers import them from here)
    MATMUL_BUCKETS,
    MATMUL_STRATEGIES,
    Linear,
    _bucket,
    _padded_candidates,
    matmul,
    planned_matmul,
    tune_matmul_plan,
)


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    head_dim_override: int | None = None
    rope_scaling: dict | None = None  # Llama-3 style {"factor", "low_freq_factor", ...}, or {"rope_type": "linear"}
    # Gemma 3 (see the module docstring); the defaults are Llama's
    embed_scale: float | None = None  # input embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    qk_norm: bool = False  # RMSNorm over head_dim on every head's q and k, before RoPE
    sandwich_norm: bool = False  # RMSNorm on the attention output and on the FFN output before each residual add
    activation: str = "silu"  # the FFN gate's activation: "silu" or "gelu_tanh"
    attn_scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    sliding_window: int | None = None  # local layers see the keys of the last sliding_window positions only
    local_layers: tuple[int, ...] = ()  # the local layers (sliding window, rope_theta_local)
    rope_theta_local: float | None = None  # RoPE base of the local layers (None: rope_theta)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def llama_layers(self) -> bool:
        """Whether every layer is a plain Llama layer (what the native fused decoder runs)."""
        plain = self.embed_scale is None and not (self.qk_norm or self.sandwich_norm or self.local_layers)
        return plain and self.activation == "silu" and self.attn_scale is None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        bad = [i for i in self.local_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"local_layers {bad} are not layers of a {self.num_layers}-layer model")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {self.sliding_window}")


# the FFN gate's activation by LlamaConfig.activation (gelu_tanh: transformers' "gelu_pytorch_tanh")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rope_frequencies(cfg: LlamaConfig, device: torch.device | str = "cpu", local: bool = False) -> Tensor:
    """Inverse frequencies ``(head_dim/2,)``, with optional Llama-3 or linear rope scaling; ``local``: those of the
    local (sliding-window) layers, ``rope_theta_local`` without scaling (as Gemma 3's local layers)."""
    hd = cfg.head_dim
    theta = cfg.rope_theta_local if local and cfg.rope_theta_local is not None else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    rs = None if local else cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "linear":
        inv = inv / float(rs["factor"])
    elif rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (HF layout). x: (B, nh, T, hd); cos/sin: (B, 1, T, hd)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    """Llama's RMSNorm: ``weight * norm(x)`` with the normalised x cast to x's dtype first. ``fp32_weight`` (Gemma,
    whose weights are 1 + w): the product is taken in float32 and cast once, and the weight stays float32 when the
    model is cast (as transformers' Gemma3RMSNorm computes ``norm(x) * (1 + w.float())``; 1 + w in bf16 would be off
    by up to 2^-9). In float32 both forms give the same bits."""

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fp32_weight = fp32_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (xf * self.weight.float()).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        if not self.fp32_weight:
            return super()._apply(fn, recurse)
        w = self.weight.detach().float()  # before a dtype cast rounds it
        out = super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = w.to(self.weight.device)
        return out


class Attention(watch.WatchedAttrs, nn.Module):
    # True: decode steps (cache, start > 0, T <= EXACT_MAX_T) use treedraft.kernels.attend, whose tree rows
    # equal the plain one-token step bitwise (set by quant.swap_linears with the native int8-activation
    # linears, which turn SDPA's ~1e-7 masked/unmasked differences into different tokens)
    exact_attention: bool = False
    # True (with exact_attention): the native attention's scores in bf16 (treedraft.kernels.attend bf16_scores: q and k
    # rounded to bf16, summed as vdpbf16ps does), about twice as fast a score pass; rows stay bitwise row-invariant
    bf16_scores: bool = False
    WATCHED = ("exact_attention", "bf16_scores")  # read by the fused decoder, not registered attributes (watch.py)
    EXACT_MAX_T = 64

    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.softmax_scale
        self.local = layer in cfg.local_layers  # a sliding-window layer (its masks and RoPE come from Transformer)
        q_out, kv_out = self.nh * self.hd, self.nkv * self.hd
        # fused q/k/v projection: one matmul instead of three (rows: q, k, v)
        self.wqkv = Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.qkv_bias)
        self.wo = Linear(q_out, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps, cfg.sandwich_norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps, cfg.sandwich_norm) if cfg.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, start: int
    ) -> Tensor:
        B, T, _ = x.shape
        qkv = self.wqkv(x)
        q_out, kv_out = self.nh * self.hd, self.nkv * self.hd
        q, k, v = qkv.split((q_out, kv_out, kv_out), dim=-1)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, start, k, v)  # (B, nkv, start+T, hd)
        y = self._attend(q, k, v, mask, start, cache is not None)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.wo(y)

    def forward_packed(self, x: Tensor, cos: Tensor, sin: Tensor, segments: Sequence[Segment]) -> Tensor:
        """x (M, H) rows of several requests; cos/sin (M, 1, hd); attention per segment over its own cache."""
        M = x.shape[0]
        qkv = self.wqkv(x)  # (M, (nh + 2 nkv) hd): one pass over the weights for every request's rows
        q_out, kv_out = self.nh * self.hd, self.nkv * self.hd
        q, k, v = qkv.split((q_out, kv_out, kv_out), dim=-1)
        q, k = q.view(M, self.nh, self.hd), k.view(M, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (M, nh | nkv, hd), each row on its own
        v = v.view(M, self.nkv, self.hd)
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, nkv, M, hd) views
        out, r0 = [], 0
        for seg in segments:
            r1, start = r0 + seg.rows, seg.start
            ks, vs = seg.cache.update(self.layer, start, kt[:, :, r0:r1], vt[:, :, r0:r1])  # (1, nkv, L, hd)
            if self.exact_attention and start > 0 and seg.rows <= self.EXACT_MAX_T:
                # straight to the row-invariant kernel in its (rows, nh, hd) layout: the same call as _exact
                from treedraft import kernels

                mask = seg.mask
                if mask is None and seg.rows > 1:
                    mask = torch.ones(seg.rows, start + seg.rows, dtype=torch.bool, device=x.device).tril(start)
                out.append(kernels.attend(q[r0:r1], ks[0], vs[0], mask, self.scale, bf16_scores=self.bf16_scores))
            else:
                qs = q[r0:r1].transpose(0, 1)[None]  # (1, nh, rows, hd)
                out.append(self._attend(qs, ks, vs, seg.mask, start, True)[0].transpose(0, 1))  # (rows, nh, hd)
            r0 = r1
        y = torch.cat(out).reshape(M, q_out)  # (M, nh hd)
        return self.wo(y)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, start: int, cached: bool) -> Tensor:
        """q (B, nh, T, hd) against k/v (B, nkv, start+T, hd); mask (T, L) / (B, 1, T, L) or None = causal."""
        T = q.shape[2]
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        if mask is None and cached and start > 0 and T > 1:
            # causal over the new block, full view of the committed prefix
            mask = torch.ones(T, start + T, dtype=torch.bool, device=q.device).tril(start)[None, None]
        if self.exact_attention and cached and start > 0 and T <= self.EXACT_MAX_T:
            return self._exact(q, k, v, mask)
        if k.dtype != q.dtype:  # a cache stored in another dtype (Transformer.kv_dtype)
            k, v = k.to(q.dtype), v.to(q.dtype)
        gqa, sc = self.nkv != self.nh, self.scale
        if mask is None and T == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=sc)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=sc)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=sc)

    def _exact(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Row-invariant attention per batch row: q (B, nh, T, hd), k/v (B, nkv, L, hd) -> (B, nh, T, hd)."""
        from treedraft import kernels

        if q.dtype != torch.float32 or q.device.type != "cpu":
            raise RuntimeError(
                f"exact_attention needs float32 on CPU, got {q.dtype} on {q.device}; "
                "set exact_attention = False for this model"
            )
        out = []
        for b in range(q.shape[0]):
            m = None if mask is None else mask[b if mask.shape[0] > 1 else 0, 0]  # (T, L)
            out.append(
                kernels.attend(q[b].transpose(0, 1), k[b], v[b], m, self.scale, bf16_scores=self.bf16_scores).transpose(
                    0, 1
                )
            )
        return torch.stack(out)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.activation]
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        g = cfg.sandwich_norm  # Gemma: every RMSNorm's weight is 1 + w, kept in float32 (RMSNorm.fp32_weight)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, g)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, g)
        self.ffn = FeedForward(cfg)
        # Gemma's sandwich norms: on each sublayer's output, before the residual add
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, True) if g else None
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, True) if g else None

    def forward(self, x, cos, sin, mask, cache, start):
        x = _residual(x, self.attn(self.attn_norm(x), cos, sin, mask, cache, start), self.post_attn_norm)
        return _residual(x, self.ffn(self.ffn_norm(x)), self.post_ffn_norm)

    def forward_packed(self, x: Tensor, cos: Tensor, sin: Tensor, segments: Sequence[Segment]) -> Tensor:
        """x (M, H) packed rows -> (M, H)."""
        x = _residual(x, self.attn.forward_packed(self.attn_norm(x), cos, sin, segments), self.post_attn_norm)
        return _residual(x, self.ffn(self.ffn_norm(x)), self.post_ffn_norm)


def _residual(x: Tensor, y: Tensor, post: RMSNorm | None) -> Tensor:
    """x + y, y first through its sublayer's output norm where the layer has one (Gemma's sandwich norms)."""
    return x + (y if post is None else post(y))


class Transformer(nn.Module):
    """Llama-family decoder. ``forward`` returns ``(logits, hidden)``."""

    def __init__(self, cfg: LlamaConfig, init: bool = True) -> None:
        super().__init__()
        self.config = cfg
        # init=False: the weights are about to be loaded, so the embedding is left uninitialised (its normal_
        # init on the meta device goes through torch's Python reference ops, whose first use imports
        # torch._dynamo: 0.5-4 s of every process's load)
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed = nn.Embedding(*shape) if init else nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.sandwich_norm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        local = rope_frequencies(cfg, local=True) if cfg.local_layers else None
        self.register_buffer("inv_freq_local", local, persistent=False)  # the local layers' RoPE (Gemma 3)

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` / ``.half()`` / ``.to(device)`` move the weights but keep ``inv_freq`` in float32.

        Rounding the RoPE frequencies to bf16 shifts angles by up to ~0.4% (1.8 rad at position 4096 for
        head_dim 64, theta 1e4), so a cast buffer is recomputed in float32 from the config on its new device.
        """
        from .quant import QuantLinear

        # where fn sends tensors (an empty probe made where the weights are, not on a default device): the CPU-only
        # paths are checked before anything moves
        w = self.embed.weight
        off_cpu = w.device.type == "cpu" and fn(torch.empty(0, device=w.device)).device.type != "cpu"
        if off_cpu and any(isinstance(m, QuantLinear) for m in self.modules()):
            raise RuntimeError(
                "this model runs quantized weights (weights='int4' / 'int8'), whose kernels are CPU code, so it "
                "cannot move off the CPU; load it on the device instead, e.g. treedraft.load(device='cuda') "
                "(its weights load as fp32 there)"
            )
        out = super()._apply(fn, recurse)
        watch.bump()  # _apply replaces buffers without the registration hooks
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_frequencies(self.config, self.inv_freq.device)
        if self.inv_freq_local is not None and self.inv_freq_local.dtype != torch.float32:
            self.inv_freq_local = rope_frequencies(self.config, self.inv_freq_local.device, local=True)
        if off_cpu:  # the row-invariant fp32 plan and attention are native CPU kernels: the stock ops there
            self.exact_attention = False
            self.unpack()
        elif getattr(self, "matmul_plan", None) is not None:
            self.pack(self.matmul_plan)  # the plan's (in, out) weight copies are plain attributes: made again
        return out

    @property
    def exact_attention(self) -> bool:
        """Whether decode steps use the row-invariant native attention (see Attention.exact_attention)."""
        return all(b.attn.exact_attention for b in self.layers)

    @exact_attention.setter
    def exact_attention(self, on: bool) -> None:
        for b in self.layers:
            b.attn.exact_attention = bool(on)

    @property
    def bf16_scores(self) -> bool:
        """Whether the native attention's scores are in bf16 (see Attention.bf16_scores; treedraft.load(attn_scores=))."""
        return len(self.layers) > 0 and all(b.attn.bf16_scores for b in self.layers)

    @bf16_scores.setter
    def bf16_scores(self, on: bool) -> None:
        from treedraft import kernels

        if on and not kernels.bf16_scores_supported():
            raise ValueError(
                "bf16 attention scores need the native kernels built with AVX512-BF16 (this CPU's build has none)"
            )
        for b in self.layers:
            b.attn.bf16_scores = bool(on)

    @property
    def device(self) -> torch.device:
        """Where the weights live (and where ``forward`` expects its inputs)."""
        return self.embed.weight.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def input_embedding_weight(self) -> Tensor:
        """(V, H) input embedding matrix."""
        return self.embed.weight

    def output_projection_weight(self) -> Tensor:
        """(V, H) lm_head weight (the embedding itself when tied)."""
        return self.lm_head.weight

    def pack(self, plan: dict[int, str] | None = None) -> Transformer:
        """Prepare the CPU decode path: (in, out) weight copies + a per-row-count kernel plan.

        ``plan`` (rows bucket -> strategy) is measured with :func:`tune_matmul_plan` when not given.
        Call again after changing weights; :meth:`unpack` restores plain F.linear.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        tune = plan is None
        if tune:  # tuning times every kernel, the one reading the (in, out) copies too
            for m in linears:
                m.weight_t = m.weight.detach().t().contiguous()
            plan = tune_matmul_plan(linears)
        plan = dict(plan)
        uses_wt = any(v.startswith("xwt") for v in plan.values())  # else no second set of weights is kept
        for m in linears:
            if not uses_wt:
                m.weight_t = None
            elif not tune:
                m.weight_t = m.weight.detach().t().contiguous()
            m.plan = plan
        self.matmul_plan = plan
        return self

    def unpack(self) -> Transformer:
        for m in self.modules():
            if isinstance(m, Linear):
                m.weight_t = None
                m.plan = None
        self.matmul_plan = None
        return self

    # Storage dtype of new KV caches: None = the weights' dtype; torch.float16 halves the bytes a decode step
    # streams (the native attention widens each element exactly, so rows stay bitwise row-invariant; the
    # values are rounded to fp16 on write). Set on the model or through treedraft.load(kv_dtype=...).
    kv_dtype: torch.dtype | None = None

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        """Allocate an empty KV cache for ``batch`` sequences of up to ``max_len`` tokens (dtype: ``kv_dtype``)."""
        c = self.config
        p = self.embed.weight
        dtype = self.kv_dtype or p.dtype
        return KVCache(c.num_layers, batch, c.num_kv_heads, max_len or c.max_seq_len, c.head_dim, dtype, p.device)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        start: int | None = None,
        mask: Tensor | None = None,
        logits_for: Tensor | slice | None = None,
        kv_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run the decoder over new tokens.

        tokens: (B, T) ids; positions: (B, T) or (T,) rotary positions.
        cache/start: new keys/values are written at slots [start, start+T)
            (start defaults to ``cache.length``); attention covers slots [0, start+T).
        mask: boolean (T, start+T) or (B, 1, T, start+T), True = may attend;
            None = causal over everything before (plain decoding / prefill).
        logits_for: optional index into T choosing which rows get logits
            (prefill only needs the last one: the lm_head is ~20% of the FLOPs).
        kv_positions: (B, start) positions of the cached slots, for the local layers' sliding window (Gemma 3);
            None: slot j holds position j (a cache filled from slot 0 in order; a left-padded batch is not).
        Returns logits (B, T', V) in float32 and final-norm hidden states (B, T, H).
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        if positions.dim() == 1:
            positions = positions[None].expand(B, T)
        if cache is not None and start is None:
            start = cache.length
        start = start or 0
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        if cache is not None and B == 1 and start > 0 and T <= Attention.EXACT_MAX_T and kv_positions is None:
            from .fused import try_forward  # decode step in one native call; None: not applicable here

            out = try_forward(self, tokens, positions, cache, start, mask, logits_for)
            if out is not None:
                return out
        if mask is None and cache is not None and start > 0 and T > 1:
            # causal over the new block, full view of the committed prefix
            mask = torch.ones(T, start + T, dtype=torch.bool, device=tokens.device).tril(start)[None, None]
        cos, sin = self._rope(positions)  # (B, T, hd)
        glob = (cos[:, None], sin[:, None], mask)  # (B, 1, T, hd)
        loc = glob
        if self.inv_freq_local is not None:  # Gemma 3's local layers: their own RoPE and the window in the mask
            lcos, lsin = self._rope(positions, local=True)
            loc = (lcos[:, None], lsin[:, None], self._window_mask(mask, positions, start, kv_positions))
        x = self._embed(tokens)
        for layer in self.layers:
            c, s, m = loc if layer.attn.local else glob
            x = layer(x, c, s, m, cache, start)
        h = self.norm(x)
        hl = h if logits_for is None else h[:, logits_for]
        return self.lm_head(hl).float(), h

    def _embed(self, tokens: Tensor) -> Tensor:
        """Input embeddings, times ``embed_scale`` (Gemma; rounded to the weights' dtype first, as transformers does)."""
        x = self.embed(tokens)
        s = self.config.embed_scale
        return x if s is None else x * torch.tensor(s, dtype=x.dtype, device=x.device)

    def _window_mask(
        self, mask: Tensor | None, positions: Tensor, start: int, kv_positions: Tensor | None = None
    ) -> Tensor | None:
        """``mask`` ((B | 1, 1, T, start + T) bool, or None = causal) narrowed to a local layer's window: a row at
        position p sees keys at positions > p - sliding_window (transformers' sliding-window rule). Cache slot j
        < start holds position ``kv_positions[:, j]`` (default j: every cache here but a left-padded batch's is
        filled from slot 0 in order); the new rows' own slots hold ``positions``. Returns ``mask`` itself while
        every row's window covers position 0."""
        w = self.config.sliding_window
        B, T = positions.shape
        if w is None or T == 0 or int(positions.max()) < w:
            return mask
        dev = positions.device
        old = torch.arange(start, device=dev) if kv_positions is None else kv_positions.to(dev)
        kpos = torch.cat([old.expand(B, start), positions], dim=1)  # (B, start + T)
        near = kpos[:, None, :] > positions[:, :, None] - w  # (B, T, start + T)
        if mask is None:  # causal over the new block, full view of the committed prefix
            mask = torch.ones(T, start + T, dtype=torch.bool, device=dev).tril(start)[None, None]
        return mask & near[:, None]

    def _rope(self, positions: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
        """cos, sin ``(*positions.shape, hd)`` in the weights' dtype (angles computed in float32); ``local``: with
        the local layers' frequencies."""
        inv = self.inv_freq_local if local else self.inv_freq
        ang = positions[..., None].float() * inv.float()  # (..., hd/2)
        ang = torch.cat((ang, ang), dim=-1)  # (..., hd)
        dtype = self.embed.weight.dtype
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward_packed(
        self,
        tokens: Tensor,
        positions: Tensor,
        segments: Sequence[Segment],
        logits_for: Tensor | None = None,
        native_prefill: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Run the rows of several requests in one forward (continuous batching).

        tokens, positions: (M,), M = sum of ``segments[i].rows``; segment i owns the i-th consecutive
        block of rows and attends only within its own cache (written at ``[start, start + rows)``).
        The linears see all M rows at once; RoPE, norms and residuals are per row, so with row-invariant
        linears (native kernels) and ``exact_attention`` each row's result is bitwise the same whether
        its request runs alone or packed with others.
        logits_for: optional (M',) row indices that get logits (default: every row).
        native_prefill: a segment at start 0 (a prompt's first chunk) of at most :meth:`native_prefill_rows`
            rows runs in the native decoder too (else the Python path with SDPA): rounded differently from
            the Python prefill, so a caller uses it for every request or none (the batched scheduler's chunks).
        Returns logits (M', V) float32 and final-norm hidden states (M, H).
        """
        M = tokens.shape[0]
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(
                f"forward_packed takes tokens and positions of shape (M,), got {tuple(tokens.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if sum(s.rows for s in segments) != M:
            raise ValueError(f"segments cover {sum(s.rows for s in segments)} rows but {M} tokens were given")
        for s in segments:
            if s.mask is not None and tuple(s.mask.shape) != (s.rows, s.start + s.rows):
                raise ValueError(
                    f"a segment mask has shape {tuple(s.mask.shape)}, expected "
                    f"({s.rows}, {s.start + s.rows}) = (rows, start + rows)"
                )
        native = [(s.start > 0 or native_prefill) and s.rows <= Attention.EXACT_MAX_T for s in segments]
        if any(native):
            from .fused import forward_segments  # decode steps in one native call; None: not applicable

            if all(native):
                out = forward_segments(self, tokens, positions, segments, logits_for, native_prefill)
                if out is not None:
                    return out
            else:  # a segment's path never depends on what it is batched with: split, run each, reassemble
                return self._split_packed(tokens, positions, segments, native, logits_for, native_prefill)
        return self._packed_python(tokens, positions, segments, logits_for)

    def native_prefill_rows(self) -> int | None:
        """Rows of a prompt chunk the native decoder can run from slot 0 (``forward_packed(native_prefill=True)``),
        or None when this model has no native decoder (then prompts always take the Python path)."""
        from .fused import decoder_for

        return Attention.EXACT_MAX_T if decoder_for(self) is not None else None

    def _split_packed(
        self,
        tokens: Tensor,
        positions: Tensor,
        segments: Sequence[Segment],
        native: list[bool],
        logits_for,
        native_prefill: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """forward_packed over two groups (decode-step segments, the rest), results back in row order."""
        M = tokens.shape[0]
        bounds = torch.tensor([0, *(s.rows for s in segments)]).cumsum(0).tolist()
        want = torch.arange(M) if logits_for is None else torch.as_tensor(logits_for).reshape(-1).cpu()
        h = logits = None
        for flag in (True, False):
            group = [i for i, n in enumerate(native) if n == flag]
            rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in group])  # (m,) packed row ids
            local = torch.full((M,), -1, dtype=torch.long)
            local[rows] = torch.arange(rows.numel())
            pick = (local[want] >= 0).nonzero().flatten()  # which requested logits rows are in this group
            dev_rows = rows.to(tokens.device)
            lg, hg = self.forward_packed(
                tokens[dev_rows],
                positions[dev_rows],
                [segments[i] for i in group],
                local[want][pick].to(tokens.device),
                native_prefill,
            )
            if h is None:
                h = hg.new_empty(M, hg.shape[1])
                logits = lg.new_empty(want.numel(), lg.shape[1])
            h[dev_rows] = hg
            logits[pick.to(lg.device)] = lg
        return logits, h

    def _packed_python(
        self, tokens: Tensor, positions: Tensor, segments: Sequence[Segment], logits_for
    ) -> tuple[Tensor, Tensor]:
        """The reference path of forward_packed (PyTorch ops; the native linears where installed)."""
        cos, sin = self._rope(positions)  # (M, hd)
        glob = (cos[:, None], sin[:, None], segments)  # (M, 1, hd): broadcast over heads
        loc = glob
        if self.inv_freq_local is not None:  # Gemma 3's local layers: their own RoPE, each segment's window
            lcos, lsin = self._rope(positions, local=True)
            local_segs, r0 = [], 0
            for sg in segments:
                m = None if sg.mask is None else sg.mask[None, None]
                lm = self._window_mask(m, positions[r0 : r0 + sg.rows][None], sg.start)
                local_segs.append(sg if lm is m else replace(sg, mask=lm[0, 0]))
                r0 += sg.rows
            loc = (lcos[:, None], lsin[:, None], local_segs)
        x = self._embed(tokens)  # (M, H)
        for layer in self.layers:
            c, s, sg = loc if layer.attn.local else glob
            x = layer.forward_packed(x, c, s, sg)
        h = self.norm(x)
        hl = h if logits_for is None else h[logits_for]
        return self.lm_head(hl).float(), h
