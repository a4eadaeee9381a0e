"""Sampling parameters and the logits -> probabilities transform shared by all rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A seeded CPU generator; every draw (see :func:`sample`) happens on the CPU, whatever the model's device,
        so a seed gives the same tokens on cpu and cuda (for the same logits)."""
        g = torch.Generator()
        if self.seed is not None:
            g.manual_seed(int(self.seed))
        else:
            g.seed()
        return g


def target_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """(N, V) logits -> (N, V) probabilities after temperature, top-k and top-p (float32)."""
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        # drop tokens once the mass *before* them already reaches top_p (always keep the first)
        drop = (sp.cumsum(-1) - sp) >= p.top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, gen: torch.Generator) -> int:
    """Draw one token id from a (V,) distribution (on any device) with a CPU generator."""
    return int(torch.multinomial(probs.to(device="cpu"), 1, generator=gen).item())
