"""One native call per decode forward (issue 11): the whole decoder stack of a step in C++.

A Python decode step of the 135M model runs ~400 small aten ops (RMSNorm, RoPE, residuals, casts,
cache writes) around the native linears and attention: ~17 ms of per-op overhead against ~5 ms of
weight streaming. :class:`treedraft.kernels` ``FusedDecoder`` (kernels/fused.h) runs embedding, every
layer (RMSNorm -> qkv -> RoPE -> cache write -> row-invariant attention -> wo -> residual -> RMSNorm ->
w13 -> silu*up -> w2 -> residual), the final norm and the lm_head in one call.

It serves :meth:`Transformer.forward` when every linear is a native :class:`~.quant.NativeLinear`,
``exact_attention`` is on, B == 1, a cache is given, ``start > 0`` and ``T <= Attention.EXACT_MAX_T``
(the decode steps whose attention already is the native row-invariant one); everything else keeps the
Python path. Every row is computed from that row alone in a fixed order (see fused.h), so a tree row
equals the 1-token row bitwise and greedy speculative output equals plain output. Its results differ
from the Python path by float rounding only (RMSNorm sum order, cos/sin, silu's exp): a few 1e-6
relative on the tiny test models, see tests/test_fused.py.

``TREEDRAFT_NO_FUSED=1`` turns it off; without the native extension it is off automatically.
:func:`forward_segments` is the packed-rows entry point for batched serving (one segment per request).
"""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import watch

ENV_DISABLE = "TREEDRAFT_NO_FUSED"
_EMPTY_MASK = torch.empty(0, dtype=torch.bool)
_CACHE_DTYPES = (torch.float32, torch.float16)  # KV cache storage the native decoder reads (kernels/attn_kv.h)

__all__ = ["ENV_DISABLE", "Seg", "disabled", "status", "decoder_for", "forward_segments", "try_forward"]


@dataclass(frozen=True)
class Seg:
    """One request's rows in a packed forward (same fields as ``llama.Segment`` of the batch contract)."""

    cache: Any  # KVCache with batch 1
    start: int  # slot where this segment's new keys/values go
    rows: int  # rows (tokens) of this segment in the packed input
    mask: Tensor | None  # bool (rows, start + rows), True = may attend; None = causal


def disabled() -> bool:
    """Whether ``TREEDRAFT_NO_FUSED`` turns the fused path off."""
    return os.environ.get(ENV_DISABLE, "") not in ("", "0")


@dataclass
class _State:
    deps: _Watch  # what the decoder was built from; rebuilt when any of it is replaced
    decoder: Any | None
    reason: str | None  # why there is no decoder
    lm_head_native: bool


@dataclass
class _Watch:
    """Slots (a dict and a key) and the object each held at build time: checked with C-level loops."""

    dicts: list[dict]
    keys: list[str]
    objs: list[Any]
    nlayers: int
    seen: int = -1  # watch.count() when every slot last checked out

    def valid(self, model) -> bool:
        if len(model.layers) != self.nlayers:
            return False
        now = watch.count()
        if now == self.seen:  # nothing assigned anywhere since the last full check (watch.py)
            return True
        ok = all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.objs))
        if ok:
            self.seen = now
        return ok


def _deps(model) -> _Watch:
    """Every module/tensor slot the decoder depends on (a replaced module, weight or flag forces a rebuild)."""
    slots: list[tuple[dict, str]] = [
        (model._modules, "embed"),
        (model.embed._parameters, "weight"),
        (model._buffers, "inv_freq"),
        (model._buffers, "inv_freq_local"),
        (model._modules, "norm"),
        (model.norm._parameters, "weight"),
        (model._modules, "lm_head"),
        (model._modules, "layers"),
    ]

    def lin(parent, name: str) -> None:
        m = parent._modules[name]
        slots.extend([(parent._modules, name), (m.__dict__, "packed"), (m._buffers, "bias")])
        slots.extend([(m._parameters, "weight"), (m._parameters, "bias"), (m.__dict__, "plan")])  # fp32 linears

    for key, b in model.layers._modules.items():
        slots.append((model.layers._modules, key))
        for name in ("attn_norm", "attn", "ffn_norm", "ffn"):
            slots.append((b._modules, name))
        slots += [(b.attn_norm._parameters, "weight"), (b.ffn_norm._parameters, "weight")]
        # Qwen3's / Gemma 3's extra norms: the slots always (a module assigned later forces a rebuild), their weights
        # where they exist
        for owner, name in ((b.attn, "q_norm"), (b.attn, "k_norm"), (b, "post_attn_norm"), (b, "post_ffn_norm")):
            slots.append((owner._modules, name))
            if owner._modules.get(name) is not None:
                slots.append((owner._modules[name]._parameters, "weight"))
        slots.append((b.attn.__dict__, "exact_attention"))
        slots.append((b.attn.__dict__, "bf16_scores"))
        lin(b.attn, "wqkv"), lin(b.attn, "wo"), lin(b.ffn, "w13"), lin(b.ffn, "w2")
    lin(model, "lm_head")
    dicts, keys = [d for d, _ in slots], [k for _, k in slots]
    return _Watch(dicts, keys, [d.get(k) for d, k in slots], len(model.layers), watch.count())


_EMPTY_F32 = torch.empty(0, dtype=torch.float32)


def linear_bias(m) -> Tensor:
    """A native linear's bias as fused.h takes it: contiguous float32, or an empty tensor for none."""
    return _EMPTY_F32 if m.bias is None else m.bias.detach().float().contiguous()


KIND_F32 = 2  # fused.h / mm_core.h kF32: float32 (N, K) weights through kernels/f32mm.h


def exact_f32(m) -> bool:
    """An fp32 linear the fused decoder can run as it is: the row-invariant plan's (models/matmul.py EXACT)."""
    from .matmul import Linear, is_exact_plan

    w = m.weight if isinstance(m, Linear) else None
    return w is not None and w.dtype == torch.float32 and w.device.type == "cpu" and is_exact_plan(m.plan)


def lin_data(m) -> tuple[Tensor, Tensor, int]:
    """(data, bias, kind) of a native or exact-fp32 linear as fused.h takes them."""
    if exact_f32(m):
        return m.weight.detach().contiguous(), linear_bias(m), KIND_F32
    return m.packed.data, linear_bias(m), m.packed.kind


def layer_tensors(block) -> tuple[list[Tensor], list[int]]:
    """One decoder layer's tensors in fused.h's order (attn_norm, ffn_norm, then data and bias of wqkv, wo,
    w13, w2) and the four linears' kinds; the caller has checked the linears are native or exact fp32."""
    lins = (block.attn.wqkv, block.attn.wo, block.ffn.w13, block.ffn.w2)
    tensors = [w.detach().float().contiguous() for w in (block.attn_norm.weight, block.ffn_norm.weight)]
    kinds = []
    for m in lins:
        data, bias, kind = lin_data(m)
        tensors += [data, bias]
        kinds.append(kind)
    return tensors, kinds


def _build(model, deps: _Watch) -> _State:
    """A FusedDecoder for ``model``, or the reason it cannot have one."""
    from treedraft import kernels

    from .quant import NativeLinear

    def no(reason: str) -> _State:
        return _State(deps, None, reason, False)

    if not kernels.available():
        return no(f"native extension unavailable ({kernels.unavailable_reason()})")
    ext = kernels._ext()
    if not hasattr(ext, "FusedDecoder"):
        return no("the loaded native extension has no FusedDecoder")
    cfg = model.config
    emb = model.embed.weight
    if emb.dtype != torch.float32 or emb.device.type != "cpu":
        return no(f"needs float32 weights on CPU, got {emb.dtype} on {emb.device}")
    if not model.exact_attention:
        return no("exact_attention is off")
    tensors: list[Tensor] = []
    kinds: list[int] = []
    eps = {n.eps for b in model.layers for n in _layer_norms(b)} | {model.norm.eps}
    if len(eps) != 1:
        return no(f"RMSNorm eps differs between layers: {sorted(eps)}")
    for i, b in enumerate(model.layers):
        for m in (b.attn.wqkv, b.attn.wo, b.ffn.w13, b.ffn.w2):
            if not isinstance(m, NativeLinear) and not exact_f32(m):
                return no(f"layers.{i}: {type(m).__name__} is neither a native linear nor an exact fp32 one")
        if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in _layer_norms(b)):
            return no(f"layers.{i}: norm weights must be contiguous float32")
        t, k = layer_tensors(b)
        tensors += t
        kinds += k
    lm = model.lm_head
    lm_native = isinstance(lm, NativeLinear) or exact_f32(lm)
    lm_data, lm_bias, lm_kind = lin_data(lm) if lm_native else (torch.empty(0, dtype=torch.uint8), _EMPTY_F32, 0)
    dec = ext.FusedDecoder(
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        inter=cfg.intermediate_size,
        eps=float(eps.pop()),
        attn_scale=float(cfg.softmax_scale),  # what Attention._exact passes
        embed=emb.detach().contiguous(),
        inv_freq=model.inv_freq.float().contiguous(),
        layers=tensors,
        kinds=kinds,
        final_norm=model.norm.weight.detach().float().contiguous(),
        lm_head=lm_data,
        lm_head_bias=lm_bias,
        lm_head_kind=lm_kind,
        vocab=lm.out_features if lm_native else cfg.vocab_size,
    )
    if not cfg.llama_layers:
        local = model.inv_freq_local
        dec.set_variant(
            embed_scale=float(cfg.embed_scale or 0.0),
            qk_norms=[n.weight.detach().float().contiguous() for b in model.layers for n in _qk_norms(b)],
            post_norms=[n.weight.detach().float().contiguous() for b in model.layers for n in _post_norms(b)],
            inv_freq_local=_EMPTY_F32 if local is None else local.float().contiguous(),
            local=list(cfg.local_layers),
            window=int(cfg.sliding_window or 0),
            gelu=cfg.activation == "gelu_tanh",
        )
    if model.bf16_scores:
        dec.set_bf16_scores(True)
    return _State(deps, dec, None, lm_native)


def _layer_norms(block) -> list:
    """Every RMSNorm of a layer: its input and pre-FFN norms, then the q/k and sandwich ones where it has them."""
    return [block.attn_norm, block.ffn_norm, *_qk_norms(block), *_post_norms(block)]


def _qk_norms(block) -> list:
    """A layer's q and k head RMSNorms (Gemma 3, Qwen3), in set_variant's order; [] for a Llama layer."""
    return [] if block.attn.q_norm is None else [block.attn.q_norm, block.attn.k_norm]


def _post_norms(block) -> list:
    """A layer's post-attention and post-FFN RMSNorms (Gemma's sandwich), in set_variant's order; [] for Llama."""
    return [] if block.post_attn_norm is None else [block.post_attn_norm, block.post_ffn_norm]


# model -> its decoder state, outside the module so deepcopy / pickle of a model never meets the C++ object
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(model) -> _State:
    st: _State | None = _STATES.get(model)
    if st is None or not st.deps.valid(model):
        st = _build(model, _deps(model))
        _STATES[model] = st
    return st


def decoder_for(model) -> Any | None:
    """The model's native FusedDecoder (built once, rebuilt when a weight module is replaced), or None."""
    return None if disabled() else _state(model).decoder


def status(model) -> str | None:
    """None when decode steps of ``model`` run fused, else why not."""
    if disabled():
        return f"disabled by {ENV_DISABLE}"
    return _state(model).reason


def forward_segments(
    model,
    tokens: Tensor,
    positions: Tensor,
    segments: Sequence[Any],
    logits_for: Tensor | None = None,
    from_zero: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """Packed decode forward of several requests' rows in one native call, or None when not applicable.

    tokens/positions: (M,) with M = sum(s.rows); segment i owns the i-th consecutive block of rows, writes
    its keys/values into ``s.cache`` at ``[s.start, s.start + s.rows)`` and attends under ``s.mask``
    (bool (rows, start + rows) or None = causal). logits_for: (M',) int64 row indices or None (all rows).
    from_zero: segments may start at slot 0 (a prompt's first chunk; the caller chunks every prompt so).
    Returns (logits (M', V) float32, final-norm hidden (M, H)).
    """
    st = None if disabled() else _state(model)
    if st is None or st.decoder is None:
        return None
    if torch.is_grad_enabled() and model.embed.weight.requires_grad:
        return None  # the native call records no autograd graph
    rows, starts, ks, vs, masks = [], [], [], [], []
    for s in segments:
        ck, cv = getattr(s.cache, "k", None), getattr(s.cache, "v", None)
        if not isinstance(ck, list) or not isinstance(cv, list) or not ck:
            return None  # not a KVCache of per-layer tensors
        k0 = ck[0]
        first = s.start < 0 or (s.start == 0 and not from_zero)
        if k0.shape[0] != 1 or k0.dtype not in _CACHE_DTYPES or first or s.start + s.rows > s.cache.max_len:
            return None
        m = _EMPTY_MASK
        if s.mask is not None:
            m = s.mask
            if m.dim() == 4:
                m = m[0, 0] if m.shape[0] == 1 else None
            if m is None or m.dtype != torch.bool:
                return None
        rows.append(int(s.rows))
        starts.append(int(s.start))
        ks.append(ck)
        vs.append(cv)
        masks.append(m)
    tok = tokens.reshape(-1).to(torch.long).contiguous()
    pos = positions.reshape(-1).to(torch.long).contiguous()
    logits, h = st.decoder.forward(tok, pos, rows, starts, ks, vs, masks, logits_for, st.lm_head_native)
    if not st.lm_head_native:
        logits = model.lm_head(h if logits_for is None else h[logits_for]).float()
    return logits, h


def try_forward(
    model,
    tokens: Tensor,
    positions: Tensor,
    cache: Any,
    start: int,
    mask: Tensor | None,
    logits_for: Tensor | slice | None,
) -> tuple[Tensor, Tensor] | None:
    """:meth:`Transformer.forward` for one request (tokens (1, T)) through the native decoder, or None.

    Returns (logits (1, T', V) float32, hidden (1, T, H)) exactly as the Python path shapes them.
    """
    T = tokens.shape[-1]
    rows = None
    if logits_for is not None:
        rows = torch.arange(T)[logits_for]
        if rows.dim() != 1:
            return None
    pos = positions if positions.dim() == 1 else positions[0]
    out = forward_segments(model, tokens, pos, (Seg(cache, start, T, mask),), rows)
    if out is None:
        return None
    logits, h = out
    return logits[None], h[None]
