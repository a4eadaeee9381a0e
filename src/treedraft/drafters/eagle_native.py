"""The EAGLE draft step as one native call (kernels/fused.h ``FusedDecoder`` with ``set_eagle_input``).

A draft forward in Python (fc, RMSNorms, the layer's linears, RoPE, SDPA, the draft-vocabulary head) is
~60 small aten ops around 6 native matmuls: 15-25 ms on the loaded 2-core Xeon where the target's whole
30-layer step is one ~11 ms native call. Here a depth is ONE call: the decoder embeds the tokens, runs
fc([emb_norm(embed(x)) ; feat_norm(f)]) -> the one decoder layer (its k/v go into the drafter's own
KVCache at the given slots, attending under the tree mask) -> no final norm (EAGLE predicts the
target's final-norm features directly) -> the draft head (q8) for the chosen rows.

Weights are the ones :func:`~treedraft.drafters.eagle.fast_drafting` quantizes (group-32 q8,
round-to-nearest), so this path drafts like the PyTorch path over the same native linears, up to float
rounding (RMSNorm sum order, exp in silu): tests/test_eagle_native.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

_EMPTY_F32 = torch.empty(0, dtype=torch.float32)
_EMPTY_MASK = torch.empty(0, dtype=torch.bool)


class NativeDraftStep:
    """``step(feats, toks, pos, cache, start, mask, logit_rows)`` -> (logits (R, V') | None, features (e, H))."""

    def __init__(self, decoder: Any, vocab: int) -> None:
        self.decoder = decoder
        self.vocab = vocab  # columns of the draft head

    def __call__(
        self,
        feats: Tensor,
        toks: Tensor,
        pos: Tensor,
        cache: Any,
        start: int,
        mask: Tensor | None,
        logit_rows: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """feats (e, H) float32, toks/pos (e,) int64: keys/values to cache slots [start, start + e), attending
        under mask (e, start + e) bool (None: causal); logits (R, V') for logit_rows (None: all rows)."""
        e = int(toks.shape[0])
        if start + e > cache.max_len:
            raise ValueError(f"eagle draft cache overflow: writing up to {start + e} > max_len {cache.max_len}")
        logits, hidden = self.decoder.forward(
            toks,
            pos,
            [e],
            [int(start)],
            [cache.k],
            [cache.v],
            [_EMPTY_MASK if mask is None else mask],
            logit_rows,
            True,
            feats,
        )
        return logits, hidden


def native_draft_step(fast: torch.nn.Module, head: Any) -> NativeDraftStep | None:
    """The one-call draft step of ``fast`` (an EagleNet whose linears are native, from ``fast_drafting``) with
    ``head`` (a native linear over the draft vocabulary), or None when the native extension cannot run it."""
    from .. import kernels
    from ..models.fused import layer_tensors, linear_bias
    from ..models.quant import NativeLinear

    if not kernels.available():
        return None
    ext = kernels._ext()
    if not hasattr(ext, "FusedDecoder") or not hasattr(ext.FusedDecoder, "set_eagle_input"):
        return None
    blk = fast.layer
    lins = (blk.attn.wqkv, blk.attn.wo, blk.ffn.w13, blk.ffn.w2)
    if not all(isinstance(m, NativeLinear) for m in (*lins, fast.fc)) or not isinstance(head, NativeLinear):
        return None
    emb = fast.embed_weight
    if emb.dtype != torch.float32 or emb.device.type != "cpu" or not emb.is_contiguous():
        return None
    c = fast.config

    def f32(t: Tensor) -> Tensor:
        return t.detach().float().contiguous()

    tensors, kinds = layer_tensors(blk)
    dec = ext.FusedDecoder(
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        inter=c.intermediate_size,
        eps=float(c.rms_eps),
        attn_scale=float(c.head_dim**-0.5),
        embed=emb.detach(),
        inv_freq=f32(fast.inv_freq),
        layers=tensors,
        kinds=kinds,
        final_norm=_EMPTY_F32,  # EAGLE's layer output is the predicted final-norm feature itself
        lm_head=head.packed.data,
        lm_head_bias=linear_bias(head),
        lm_head_kind=head.packed.kind,
        vocab=head.out_features,
    )
    dec.set_eagle_input(
        emb_norm=f32(fast.emb_norm.weight),
        feat_norm=f32(fast.feat_norm.weight),
        fc=fast.fc.packed.data,
        fc_bias=linear_bias(fast.fc),
        fc_kind=fast.fc.packed.kind,
    )
    return NativeDraftStep(dec, head.out_features)


# fast_drafting's formats: the draft layer's linears (and fc), then its draft-vocabulary head ("q4": head in q8)
DRAFT_WEIGHTS = {"q8": ("q8", "q8"), "q4": ("q4", "q8"), "q4h": ("q4", "q4")}


def fast_drafting(net: nn.Module, target: Any, weights: str = "q8") -> tuple[nn.Module, object, Tensor | None]:
    """(net, project, project_vocab) for drafting an EagleNet: on a target served by the native quantized kernels, the
    draft layer's linears and its draft-vocabulary head become native group-32 int8 (q8, round-to-nearest);
    else the net as it is, projecting with the target's quantized lm_head if it has one.

    Measured on the int4 Skylake target (one draft depth, 1-4 rows, a loaded 2-core machine: ratios only):
    the full 49k-token int4 lm_head 24-29 ms, the 4k-token draft-vocabulary head in fp32 7-14 ms and as
    q8 1.3-2.5 ms; the fp32 draft layer 22-45 ms, q8 14-18 ms. A net with the full vocabulary
    (draft_vocab 0) keeps projecting through the target's own quantized lm_head.
    """
    import copy

    from ..models.llama import Linear
    from ..models.quant import NativeLinear, QuantLinear, native_kernels, quantize_q4_rtn, quantize_q8_rtn, swap_linears

    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"EAGLE draft weights must be one of {sorted(DRAFT_WEIGHTS)}, got {weights!r}")

    from ..interfaces import target_device

    lm = getattr(target, "lm_head", None)
    lm = lm if isinstance(lm, QuantLinear) else None
    if target_device(target).type != "cpu":  # the native kernels are CPU code: a CUDA target's net crashed in them
        return net, lm, None
    natives = native_kernels()
    # a net with its own draft vocabulary needs nothing of the target's lm_head: it drafts natively whatever the
    # target's weights (an fp32 target drafted through PyTorch and, unsized, verified whole 16-node trees: 0.66x plain)
    if natives is None or (lm is None and net.vocab_map is None):
        return net, lm, None
    fast = copy.deepcopy(net)
    layer_fmt, head_fmt = DRAFT_WEIGHTS[weights]
    quantize = quantize_q4_rtn if layer_fmt == "q4" else quantize_q8_rtn
    qw = {
        n: quantize(m.weight.detach())
        for n, m in fast.named_modules()
        if isinstance(m, (Linear, nn.Linear)) and m.in_features % 32 == 0
    }
    swap_linears(fast, qw, {layer_fmt: "native"}, natives)
    fast.layer.attn.exact_attention = False  # the draft layer keeps SDPA (its tree masks over the draft cache)
    if net.vocab_map is None:
        return fast, lm, None
    head = (quantize_q4_rtn if head_fmt == "q4" else quantize_q8_rtn)(net.lm_weight)
    return fast, NativeLinear(head_fmt, head.parts, None, natives), net.vocab_map
