"""Shared fixtures: the real bundled model, loaded once per test session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2 (own runtime, packed for CPU decode), no drafter."""
    import treedraft

    return treedraft.load(drafter=None, weights="fp32")  # the float reference; quantized runs: test_quant


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own LlamaForCausalLM on the same GGUF weights (the parity reference)."""
    from transformers import AutoModelForCausalLM

    from treedraft.models.registry import resolve

    p = resolve("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
