"""Shared fixtures: the real bundled model, loaded once per test session."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator

import pytest
import torch

# The suite keeps its own cache (converted weights, kernels, and above all the timings it measures while its two
# xdist workers share the cores, stored as quiet by timing_cache_ignores_other_processes below): in the user's cache
# they were what `treedraft generate` used next (a latency curve cached beside a test run read 2 / 4 rows at 1.48 /
# 2.08 one-row forwards against 1.05 / 1.08, and the default drafter drafted 0.6 nodes a step instead of 2-3). The
# cached curves' check against the machine (budget.CHECK_ENV) is off here for the same reason; its own tests turn
# it on.
_cache_root = os.environ.get("TREEDRAFT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "treedraft"))
if os.path.basename(os.path.normpath(_cache_root)) != "tests":  # (xdist workers inherit the controller's setting)
    os.environ["TREEDRAFT_CACHE"] = os.path.join(_cache_root, "tests")
os.environ["TREEDRAFT_CURVE_CHECK"] = "0"
# Step costs learned in decoding (treedraft/step_costs.py) are off here too: the learner is shared by every request
# of a process and takes a one-row step now and then, so two identical requests would verify different trees and
# the tests that compare their accepted counts could not; test_step_costs.py turns it on.
os.environ["TREEDRAFT_LEARN_COSTS"] = "0"

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


@pytest.fixture(autouse=True)
def timing_cache_ignores_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached timings in the test process are stored as quiet and never re-measured for load: the other
    pytest-xdist worker is "another process" to models/plan.py's busy rule, and whether it happens to be idle
    at a sample must not decide whether a test measures again (tests of the rule patch these themselves)."""
    from treedraft.models import plan

    monkeypatch.setattr(plan.CpuWindow, "others", lambda self: 0.0)
    monkeypatch.setattr(plan, "others_now", lambda seconds=plan.QUIET_SAMPLE_S: 1.0)
    monkeypatch.setattr(plan, "load_average", lambda: 0.0)


@contextlib.contextmanager
def start_threads() -> Iterator[None]:
    """Torch at the startup thread count inside (restored after): real-model work in a module that holds one
    thread measures (step latency, Medusa tree) under the same cache keys as the rest of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(START_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def one_loader_at_a_time() -> Iterator[None]:
    """Hold an exclusive lock on a file in TREEDRAFT_CACHE: pytest-xdist workers share the cache, so the
    first real-model load does the first-use work (GGUF conversion, tokenizer, weights=auto measurement)
    once while the other worker waits, then reads it from the cache instead of measuring it again at once."""
    from treedraft.models.cache import cache_dir

    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".test-load.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_real(**kw):
    """``treedraft.load(**kw)`` with the startup thread count (restored after), so the loads of a test
    session share one set of cached measurements whatever thread count the calling test holds."""
    import treedraft

    with start_threads(), one_loader_at_a_time():
        return treedraft.load(**kw)


SPEC_PROMPTS = (
    "Write a haiku about the sea.",
    "List three uses of a paperclip and explain each one.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
)


def assert_spec_equals_plain(llm, prompts=SPEC_PROMPTS, max_new_tokens: int = 64) -> list[float]:
    """Greedy output with ``llm``'s drafter equals plain greedy output on each prompt (``max_new_tokens``, EOS
    ignored); returns each drafted run's mean accepted length."""
    from treedraft.engine import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    accepted = []
    for prompt in prompts:
        ids = llm.encode_prompt(prompt)
        plain = llm.engine.generate(ids, cfg, None)
        spec = llm.engine.generate(ids, cfg, llm.engine.drafter)
        assert spec.token_ids == plain.token_ids, prompt
        accepted.append(spec.stats.mean_accepted_length)
    return accepted


def fixed_matmul_plan() -> dict[int, str]:
    """An fp32 kernel plan chosen without timing that runs every kernel of the packed path: one row by the
    duplicated-row GEMM (wxt), the longest bucket padded (xwt@64), the other buckets cycling through their
    candidates (plain, transposed copy, skinny GEMM and the zero-padded variants)."""
    from treedraft.models.matmul import MATMUL_BUCKETS, _padded_candidates

    plan = {b: _padded_candidates(b)[i % len(_padded_candidates(b))] for i, b in enumerate(MATMUL_BUCKETS)}
    plan.update({1: "wxt", 64: "xwt@64"})
    return plan


def load_real_fp32_fixed_plan(**kw):
    """:func:`load_real` with ``weights='fp32'`` packed with :func:`fixed_matmul_plan` instead of the measured
    plan: timing every kernel for 20 row buckets over the real weights is the slowest first-use step of a cold
    cache (~40 s quiet, minutes under load) and proves nothing about correctness; the measurement itself is
    tested on tiny models (test_models_layer.py::test_pack_tuned_caches_the_kernel_plan, test_model.py)."""
    import treedraft.api

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(treedraft.api, "pack_tuned", lambda net, path, dtype: net.pack(fixed_matmul_plan()))
        return load_real(weights="fp32", **kw)


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
    """The bundled SmolLM2 (own runtime, packed for CPU decode with a fixed kernel plan), no drafter."""
    return load_real_fp32_fixed_plan(drafter=None)  # the float reference; quantized runs: test_quant


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own LlamaForCausalLM on the same GGUF weights (the parity reference)."""
    from transformers import AutoModelForCausalLM

    from treedraft.models.registry import resolve

    p = resolve("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm_int4(warm_cache):
    """The bundled SmolLM2 as users get it here (int4 weights, native kernels when built), no drafter: for
    drafter tests on the real model, whose greedy outputs do not depend on the float path (a decode step
    costs a fraction of the fp32 Python path's; the int4 kernel choice comes from warm_cache)."""
    return load_real(drafter=None, weights="int4")
