"""Shared fixtures: the real bundled model, loaded once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

# torch's intra-op thread count at startup: what a user and the CLI subprocesses of the tests run with.
# Per-machine measurements (kernel plan, weights=auto, Medusa tree) are cached per thread count, so a
# model loaded while a fixture holds one thread would measure everything again (tens of seconds).
START_THREADS = torch.get_num_threads()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``extended`` tests (minutes each: a second real model end to end) run only with TREEDRAFT_EXTENDED=1
    (``make test-extended``), which keeps ``make test`` within its time budget."""
    if os.environ.get("TREEDRAFT_EXTENDED", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="extended test: run with TREEDRAFT_EXTENDED=1 (make test-extended)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


def load_real(**kw):
    """``treedraft.load(**kw)`` with the startup thread count (restored after), so the loads of a test
    session share one set of cached measurements whatever thread count the calling test holds."""
    import treedraft

    before = torch.get_num_threads()
    torch.set_num_threads(START_THREADS)
    try:
        return treedraft.load(**kw)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def real_loader() -> Callable[..., object]:
    """:func:`load_real` as a fixture, for test modules that load the real model with their own options."""
    return load_real


@pytest.fixture(scope="session")
def warm_cache() -> None:
    """Load the default model once in this process (weights=auto), so that the first-use work (GGUF
    conversion, tokenizer, the weights=auto measurement, the native kernel build) lands in TREEDRAFT_CACHE
    before CLI subprocess tests that would otherwise pay it inside their timeout."""
    load_real(drafter=None).close()


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2 (own runtime, packed for CPU decode), no drafter."""
    return load_real(drafter=None, weights="fp32")  # the float reference; quantized runs: test_quant


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own LlamaForCausalLM on the same GGUF weights (the parity reference)."""
    from transformers import AutoModelForCausalLM

    from treedraft.models.registry import resolve

    p = resolve("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
