"""Tiny seeded models for fast unit tests."""

from __future__ import annotations

import torch

from .llama import LlamaConfig, Transformer


def tiny_llama(
    seed: int = 0,
    vocab_size: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_seq_len: int = 256,
    scale: float = 1.0,
) -> Transformer:
    """A random Llama with GQA; ``scale`` sharpens the output distribution."""
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        max_seq_len=max_seq_len,
        rope_theta=10000.0,
        tie_embeddings=False,
    )
    g = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
        model.lm_head.weight.mul_(scale * 8)
    return model.eval().requires_grad_(False)
