"""Compact Llama-family transformer (Llama 2/3, SmolLM2, Qwen2/Mistral-style GQA).

In the style of gpt-fast: a plain ``nn.Module`` whose only state besides weights
is the :class:`KVCache` the caller hands to :meth:`Transformer.forward`.
Positions and the attention mask are explicit arguments, so a tree of draft
tokens is just another batch of tokens with its own positions and mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
    rope_scaling: dict | None = None  # Llama-3 style {"factor", "low_freq_factor", ...}

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")


class KVCache:
    """Pre-allocated per-layer key/value buffers: ``(B, n_kv, max_len, head_dim)``.

    ``length`` counts committed positions. :meth:`Transformer.forward` writes new
    entries at slots ``[start, start + T)``; :meth:`keep` compacts a chosen subset
    of those slots (the accepted tree path) down to ``start`` and commits them.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v ``(B, n_kv, T, hd)`` at ``start``; return views of slots ``[0, start+T)``."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to {end} > max_len {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def keep(self, start: int, indices: Tensor | list[int]) -> None:
        """Keep slots ``start + indices`` (in order) at ``start ...``; set length accordingly."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.k[0].device)
        n = int(idx.numel())
        contiguous = bool(n == 0 or torch.equal(idx, torch.arange(n, device=idx.device)))
        if not contiguous:
            src = idx + start
            for buf in (*self.k, *self.v):
                buf[:, :, start : start + n] = buf.index_select(2, src)
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Forget everything at or after ``length``."""
        self.length = min(self.length, length)


def rope_frequencies(cfg: LlamaConfig, device: torch.device | str = "cpu") -> Tensor:
    """Inverse frequencies ``(head_dim/2,)``, with optional Llama-3 rope scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
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


# every row count up to 16 (tree sizes on a CPU) gets its own entry, larger ones share a bucket
MATMUL_BUCKETS = (*range(1, 17), 24, 32, 48, 64)
MATMUL_STRATEGIES = ("linear", "xwt", "wxt")


def _padded_candidates(rows: int) -> list[str]:
    """Kernels for ``rows`` rows, including ``name@p``: pad x with zero rows to p, drop them after.

    Measured here: MKL's skinny GEMM runs 4, 8 and 16 rows at full speed but 13-15 rows up to 1.8x
    slower than 16 (the microkernel width), so a 15-node tree cost more than a 16-node one.
    """
    out = list(MATMUL_STRATEGIES)
    if rows > 16:  # buckets above 16 are measured at the bucket size: pad every row count up to it
        return [f"{s}@{rows}" for s in out]
    for mult in (4, 8, 16):
        p = -(-rows // mult) * mult
        if p > rows and f"wxt@{p}" not in out:
            out.append(f"wxt@{p}")
    return out


def _bucket(rows: int) -> int:
    for b in MATMUL_BUCKETS:
        if rows <= b:
            return b
    return 0  # larger than every bucket: plain F.linear


def matmul(strategy: str, x: Tensor, w: Tensor, wt: Tensor | None) -> Tensor:
    """x (M, K) times w (N, K)^T by one of three equivalent kernels (results differ by float rounding).

    linear: F.linear(x, w); xwt: x @ wt with a contiguous (K, N) copy; wxt: (w @ x^T)^T, which BLAS
    runs as a GEMM with a skinny right-hand side (one row is duplicated so it never degrades to GEMV).
    """
    if strategy == "xwt" and wt is not None:
        return x @ wt
    if strategy == "wxt":
        # x^T as a column-major view of a row-major x: the layout MKL's skinny GEMM is fast on;
        # the (M, N) result is made row-major again so attention/SDPA keep their fast kernels
        xx = torch.cat((x, x)) if x.shape[0] == 1 else x.contiguous()
        return torch.mm(w, xx.t()).t()[: x.shape[0]].contiguous()
    return F.linear(x, w)


def planned_matmul(candidate: str, x: Tensor, w: Tensor, wt: Tensor | None) -> Tensor:
    """:func:`matmul` for a plan entry: ``name`` or ``name@p`` (x zero-padded to p rows, cut back after)."""
    strategy, _, pad = candidate.partition("@")
    rows = x.shape[0]
    if pad and int(pad) > rows:
        x = torch.cat((x, x.new_zeros(int(pad) - rows, x.shape[1])))
    return matmul(strategy, x, w, wt)[:rows]


def bf16_gemm_available() -> bool:
    """Whether oneDNN has native bf16 GEMM on this CPU (AVX512-BF16 or AMX); emulated bf16 is slow."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_bf16(w: Tensor) -> Tensor:
    """A bf16 copy of ``w`` (N, K) in oneDNN's blocked layout, for :func:`linear_bf16`.

    A plain-layout bf16 weight is re-laid out by oneDNN on every call (an extra pass over it),
    so the layout is fixed once. Only for paths that may round: drafting, never the target.
    """
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16).contiguous(), None)


def linear_bf16(x: Tensor, packed: Tensor) -> Tensor:
    """x (M, K) times a :func:`pack_bf16` weight, in bf16 (float32 result)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").float()


class Linear(nn.Linear):
    """nn.Linear whose matmul kernel is chosen per row count by a measured plan.

    On this CPU (fp32, MKL) the three kernels of :func:`matmul` differ by up to 2x for the
    skinny inputs of decoding and tree verification (1-32 rows), and which one wins depends on
    the row count and the machine, so :meth:`Transformer.pack` times them and stores a plan.
    Without a plan (tests, training) it is plain F.linear.
    """

    weight_t: Tensor | None = None
    plan: dict[int, str] | None = None  # rows bucket -> strategy, shared by all Linear of a model

    def forward(self, x: Tensor) -> Tensor:
        if self.plan is None:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = planned_matmul(self.plan.get(_bucket(x2.shape[0]), "linear"), x2, self.weight, self.weight_t)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def tune_matmul_plan(linears: list[Linear], reps: int = 2, buckets: tuple[int, ...] = MATMUL_BUCKETS) -> dict[int, str]:
    """Time each strategy on every weight of the model for each row bucket; return the fastest."""
    import time

    plan: dict[int, str] = {}
    for rows in buckets:
        xs = {
            k: torch.randn(rows, k, dtype=linears[0].weight.dtype, device=linears[0].weight.device)
            for k in {m.in_features for m in linears}
        }
        best, best_t = "linear", float("inf")
        for candidate in _padded_candidates(rows):
            t_min = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for m in linears:
                    planned_matmul(candidate, xs[m.in_features], m.weight, m.weight_t)
                t_min = min(t_min, time.perf_counter() - t)
            if t_min < best_t:
                best, best_t = candidate, t_min
        plan[rows] = best
    return plan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    # True: decode steps (cache, start > 0, T <= EXACT_MAX_T) use treedraft.kernels.attend, whose tree rows
    # equal the plain one-token step bitwise (set by quant.swap_linears with the native int8-activation
    # linears, which turn SDPA's ~1e-7 masked/unmasked differences into different tokens)
    exact_attention: bool = False
    EXACT_MAX_T = 64

    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = self.nh * self.hd, self.nkv * self.hd
        # fused q/k/v projection: one matmul instead of three (rows: q, k, v)
        self.wqkv = Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.qkv_bias)
        self.wo = Linear(q_out, cfg.hidden_size, bias=False)

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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, start, k, v)  # (B, nkv, start+T, hd)
        if self.exact_attention and cache is not None and start > 0 and T <= self.EXACT_MAX_T:
            y = self._exact(q, k, v, mask)
        elif mask is None and T == 1:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.nkv != self.nh)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nkv != self.nh)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nkv != self.nh)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.wo(y)

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
            out.append(kernels.attend(q[b].transpose(0, 1), k[b], v[b], m, self.hd**-0.5).transpose(0, 1))
        return torch.stack(out)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, mask, cache, start):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, start)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-family decoder. ``forward`` returns ``(logits, hidden)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` / ``.half()`` / ``.to(device)`` move the weights but keep ``inv_freq`` in float32.

        Rounding the RoPE frequencies to bf16 shifts angles by up to ~0.4% (1.8 rad at position 4096 for
        head_dim 64, theta 1e4), so a cast buffer is recomputed in float32 from the config on its new device.
        """
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_frequencies(self.config, self.inv_freq.device)
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
        for m in linears:
            m.weight_t = m.weight.detach().t().contiguous()
        plan = dict(plan) if plan is not None else tune_matmul_plan(linears)
        for m in linears:
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

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        """Allocate an empty KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
        c = self.config
        p = self.embed.weight
        return KVCache(c.num_layers, batch, c.num_kv_heads, max_len or c.max_seq_len, c.head_dim, p.dtype, p.device)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        start: int | None = None,
        mask: Tensor | None = None,
        logits_for: Tensor | slice | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run the decoder over new tokens.

        tokens: (B, T) ids; positions: (B, T) or (T,) rotary positions.
        cache/start: new keys/values are written at slots [start, start+T)
            (start defaults to ``cache.length``); attention covers slots [0, start+T).
        mask: boolean (T, start+T) or (B, 1, T, start+T), True = may attend;
            None = causal over everything before (plain decoding / prefill).
        logits_for: optional index into T choosing which rows get logits
            (prefill only needs the last one: the lm_head is ~20% of the FLOPs).
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
        if mask is None and cache is not None and start > 0 and T > 1:
            # causal over the new block, full view of the committed prefix
            mask = torch.ones(T, start + T, dtype=torch.bool, device=tokens.device).tril(start)[None, None]
        ang = positions[..., None].float() * self.inv_freq.float()  # (B, T, hd/2), angles in float32
        ang = torch.cat((ang, ang), dim=-1)[:, None]  # (B, 1, T, hd)
        dtype = self.embed.weight.dtype
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, start)
        h = self.norm(x)
        hl = h if logits_for is None else h[:, logits_for]
        return self.lm_head(hl).float(), h
