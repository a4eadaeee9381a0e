"""bf16 GEMM through oneDNN for paths that may round (drafting, never the target)."""

from __future__ import annotations

import torch
from torch import Tensor


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
