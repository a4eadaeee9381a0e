"""Tiny seeded models on the native q4 linears (row-invariant, exact attention on), shared by the tests."""

from __future__ import annotations

import warnings

import torch

from treedraft import kernels
from treedraft.models.llama import Linear, LlamaConfig, Transformer
from treedraft.models.quant import quantize_q4_rtn, swap_linears


def make_native(model: Transformer) -> Transformer:
    """Swap every Linear of ``model`` for a native q4 linear (round-to-nearest), as load(weights='int4') does."""
    qw = {n: quantize_q4_rtn(m.weight.detach()) for n, m in model.named_modules() if isinstance(m, Linear)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pack: .* is stored as fp16")  # random weights: fp16 scales round
        swap_linears(model, qw, {"q4": "native"}, kernels)
    return model


def tiny_config(max_seq_len: int, vocab_size: int = 64) -> LlamaConfig:
    """2 layers, hidden 64, 4 heads over 2 kv heads (GQA)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        max_seq_len=max_seq_len,
    )  # fmt: skip


def tiny_native(max_seq_len: int, seed: int = 0) -> Transformer:
    """A tiny seeded model (:func:`tiny_config`) with every linear native q4."""
    torch.manual_seed(seed)
    return make_native(Transformer(tiny_config(max_seq_len)).eval())
