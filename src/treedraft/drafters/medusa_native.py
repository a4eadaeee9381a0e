"""Medusa drafting through the native int8 kernels: the heads' weights as group-32 int8 copies.

Drafting runs every step and streams the heads' weights: for the shipped SmolLM2 heads a 16384 x 576
shared projection (37.7 MB float32, 18.9 MB bf16) and 8 residual / root matrices of 576 x 576 (10.6 MB
float32), a third of what the int4 target itself streams per step. On an AVX-512 Xeon without native
bf16, oneDNN's emulated bf16 projection took ~20 ms per step against ~0.6 ms for the native int8 kernel
(``treedraft.kernels.mm``, Q8_0 weights, 9.4 MB), and the float32 residual blocks ~1.1 ms against ~0.5 ms
(benchmarks/step_overhead.py). Draft scores only rank candidate tokens, every one of which the target
verifies, so rounding them changes which tokens are proposed at near-ties, never an output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .medusa import MedusaHeads

QK = 32  # Q8_0 group size along the input dimension


def pack_q8(w: Tensor, kernels: Any) -> Any:
    """(N, K) float weight -> a native Q8_0 PackedWeight (symmetric int8 per group of 32, fp16 scales)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // QK, QK)
    scale = (g.abs().amax(-1) / 127.0).clamp_min(2.0**-14).half()  # fp16 as the kernel stores it: no rounding later
    q = torch.round(g / scale.float()[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return kernels.pack_q8_0(scale, q)


def pack_q4(w: Tensor, kernels: Any) -> Any:
    """(N, K) float weight -> a native Q4_1 PackedWeight (group-32 min/max 4-bit, round to nearest, fp16 scales)."""
    from ..models.quant import quantize_q4_rtn

    scale, minv, q = quantize_q4_rtn(w.detach()).parts
    return kernels.pack_q4_1(scale, minv, q)


PROJ_FORMATS = {"q8": pack_q8, "q4": pack_q4}  # the shared projection's native copy (the blocks stay q8)


class NativeDraft:
    """Int8 copies of a :class:`MedusaHeads`' drafting weights and the draft forward over them (the shared
    projection in ``proj_format``: "q8", or "q4" for half its bytes)."""

    def __init__(self, heads: MedusaHeads, kernels: Any, proj_format: str = "q8") -> None:
        if proj_format not in PROJ_FORMATS:
            raise ValueError(f"Medusa projection format must be one of {sorted(PROJ_FORMATS)}, got {proj_format!r}")
        self.k = kernels
        self.proj_format = proj_format
        self.proj = PROJ_FORMATS[proj_format](heads.base_weight, kernels)  # (V', H)
        # all heads' residual blocks (and root projections) stacked as one (K H, H) matrix each, packed once: the
        # first n heads are its leading n H rows (PackedWeight.first_rows), one native call for all of them. A
        # row's outputs do not depend on the other rows or columns of a call, so each head's block is the same
        # arithmetic as a call of its own (see features()).
        self.blocks: tuple[Any, Tensor] | None = None  # (W (K H, H), biases (K H,)) of the heads' one residual block
        self.root: Any | None = None  # (K H, H): the heads' root projections
        if heads.config.num_layers == 1:
            lins = [blk[0].linear for blk in heads.blocks]
            self.blocks = (
                pack_q8(torch.cat([lin.weight.detach() for lin in lins]), kernels),
                torch.cat([lin.bias.detach().float() for lin in lins]).contiguous(),
            )
            if heads.root_proj is not None:
                self.root = pack_q8(torch.cat([p.weight.detach() for p in heads.root_proj]), kernels)

    @staticmethod
    def build(heads: MedusaHeads, proj_format: str = "q8") -> NativeDraft | None:
        """Native copies when the kernels are usable for these heads (CPU, float32, shared projection,
        hidden size a multiple of 32), else None."""
        from ..models.quant import native_kernels

        w = heads.base_weight
        if heads.proj is not None or w is None or w.device.type != "cpu" or w.dtype != torch.float32:
            return None
        if w.shape[1] % QK or any(p.dtype != torch.float32 for p in heads.parameters()):
            return None
        kernels = native_kernels()
        return None if kernels is None else NativeDraft(heads, kernels, proj_format)

    def features(self, heads: MedusaHeads, h: Tensor, root: Tensor | None, n: int) -> Tensor:
        """(H,) hidden [+ root id] -> (n, H) features of the first n heads (as :meth:`MedusaHeads.hidden`)."""
        if self.blocks is None:
            return heads.hidden(h, root, n)
        mm = self.k.mm
        x = h.float().reshape(1, -1).contiguous()  # (1, H)
        H = x.shape[1]
        w, b = self.blocks[0].first_rows(n * H), self.blocks[1][: n * H]
        if self.root is not None:
            if root is None:
                raise ValueError("these heads are root-conditioned: pass the root token ids")
            e = heads.embed_weight[root].float().reshape(1, -1).contiguous()  # (1, H)
            u = (x + mm(e, self.root.first_rows(n * H)).reshape(n, H)).contiguous()  # (n, H): x + root_i(e)
        else:
            u = x.expand(n, H).contiguous()
        # all heads' blocks in one call: row i times every head's block, of which head i's is kept (the others'
        # columns are spare work, n^2 H^2 multiply-adds on weights read once: cheaper than n calls at these sizes)
        y = mm(u, w).reshape(n, n, H).diagonal(dim1=0, dim2=1).T  # (n, H): y[i] = u[i] @ W_i^T
        return u + F.silu(y + b.reshape(n, H))  # (n, H)

    def logits(self, heads: MedusaHeads, h: Tensor, root: Tensor | None, n: int) -> Tensor:
        """(H,) hidden [+ root id] -> (n, V') draft scores of the first n heads."""
        return self.k.mm(self.features(heads, h, root, n), self.proj)
