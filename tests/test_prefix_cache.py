"""Prompt prefix cache (treedraft.prefix_cache): joining requests reuse earlier prompts' prefills, exactly.

A request whose prompt (or a chunk-aligned prefix of it) was prefilled before starts from the cached keys and
values: its tokens (greedy bitwise, seeded sampled reproduced) equal its solo run's, and the forwards skip
the reused rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from spec_stats import one_thread  # noqa: F401
from test_batch import HashDrafter, V, native_tiny

from treedraft import kernels
from treedraft.engine import Engine, GenerationConfig, GenerationStats
from treedraft.prefix_cache import PrefixCache
from treedraft.sampling import SamplingParams
from treedraft.scheduler import Scheduler, run_alone

pytestmark = pytest.mark.usefixtures("one_thread")


def _entry(n: int, hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    kv = torch.arange(4 * 1 * 2 * n * 3, dtype=torch.float32).reshape(4, 1, 2, n, 3)  # 2 layers, 2 kv heads, hd 3
    return kv, (torch.randn(n, 5) if hidden else None), torch.randn(V)


def test_lookup_whole_prompt_then_longest_chunk_aligned_prefix() -> None:
    pc = PrefixCache(1 << 20, chunk_rows=4)
    a = list(range(10))
    pc.store(a, *_entry(10))
    hit = pc.lookup(a)
    assert hit is not None and hit.n == 10 and hit.entry.tokens == tuple(a)
    # shares 9 tokens with a: the longest multiple of 4 below that is 8
    hit = pc.lookup([*a[:9], 50, 51])
    assert hit is not None and hit.n == 8
    assert pc.lookup([*a[:3], 50]) is None  # shares 3 < one chunk
    hit = pc.lookup(a[:8])
    assert hit is not None and hit.n == 4  # a prefix of a: at least one row runs
    assert (pc.hits, pc.partial_hits, pc.misses) == (1, 2, 1)
    assert PrefixCache(1 << 20, None).lookup(a) is None  # nothing stored
    whole = PrefixCache(1 << 20, None)  # whole-prompt prefill: only identical prompts
    whole.store(a, *_entry(10))
    assert whole.lookup(a).n == 10 and whole.lookup([*a, 3]) is None


def test_any_boundary_reuse_confirms_tokens_not_just_hashes(monkeypatch) -> None:
    """chunk_rows=1 (a row-invariant native prefill): the longest shared prefix whatever its length; a hash match
    whose tokens differ (forced here: every prefix hashes alike) is never reused."""
    from treedraft import prefix_cache

    pc = PrefixCache(1 << 20, chunk_rows=1)
    pc.store([5, 6, 7, 8, 9], *_entry(5))
    assert pc.lookup([5, 6, 7, 1, 2]).n == 3
    assert pc.lookup([5, 6, 7, 8]).n == 3  # a prefix of the entry: its last row still runs
    monkeypatch.setattr(prefix_cache, "_prefix_hashes", lambda toks: [0] * (len(toks) + 1))
    pc = PrefixCache(1 << 20, chunk_rows=1)
    pc.store([5, 6, 7, 8, 9], *_entry(5))
    assert pc.lookup([4, 6, 7, 8, 9, 10]) is None
    assert pc.lookup([5, 6, 1, 8, 9, 10]).n == 2


def test_need_hidden_skips_entries_without_hidden_states_and_scopes_are_apart() -> None:
    pc = PrefixCache(1 << 20, chunk_rows=4)
    pc.store([1, 2, 3, 4, 5], *_entry(5, hidden=False))
    assert pc.lookup([1, 2, 3, 4, 5], need_hidden=True) is None
    assert pc.lookup([1, 2, 3, 4, 5]).n == 5
    pc.store([1, 2, 3, 4, 5, 6], *_entry(6), scope="key-a")
    assert pc.lookup([1, 2, 3, 4, 5, 6], scope="key-b") is None  # another tenant's prompt: never reused
    assert pc.lookup([1, 2, 3, 4, 5, 6, 7], scope="key-b") is None
    assert pc.lookup([1, 2, 3, 4, 5, 6], scope="key-a").n == 6
    assert pc.lookup([1, 2, 3, 4, 5, 6, 7], scope="key-a").n == 4


def test_least_recently_used_entries_go_over_the_byte_limit() -> None:
    size = PrefixCache(1 << 30, 4)
    size.store(list(range(8)), *_entry(8))
    one = size.nbytes
    pc = PrefixCache(2 * one + one // 2, chunk_rows=4)  # room for two entries of 8 tokens
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    pc.store(a, *_entry(8))
    pc.store(b, *_entry(8))
    assert pc.lookup(a).n == 8  # a is now the most recently used
    pc.store(c, *_entry(8))
    assert len(pc) == 2 and pc.nbytes == 2 * one
    assert pc.lookup(b) is None and pc.lookup(b[:4] + [0, 0]) is None  # evicted, with its prefixes
    assert pc.lookup(a).n == 8 and pc.lookup(c).n == 8
    big = PrefixCache(one - 1, 4)
    big.store(a, *_entry(8))
    assert len(big) == 0  # larger than the whole cache: not kept


def test_store_checks_shapes_and_copies() -> None:
    pc = PrefixCache(1 << 20, chunk_rows=4)
    kv, h, lg = _entry(6)
    with pytest.raises(ValueError, match="prefix entry of 5 tokens"):
        pc.store([1, 2, 3, 4, 5], kv, h, lg)
    pc.store([1, 2, 3, 4, 5, 6], kv, h, lg)
    kv.zero_()
    assert pc.lookup([1, 2, 3, 4, 5, 6]).entry.kv.abs().sum() > 0  # a private copy
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(0, 4)


def _shared_prefix_requests(seed: int, lo: int, hi: int) -> list[tuple[list[int], GenerationConfig]]:
    """Prompts in families that share long prefixes (and some repeated whole), greedy and seeded sampled."""
    rng = random.Random(seed)
    bases = [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(3)]
    out = []
    for i in range(9):
        base = bases[i % 3]
        prompt = list(base) if i < 6 else base[: len(base) - 3] + [rng.randrange(V) for _ in range(5)]
        sp = SamplingParams(temperature=0.8, seed=7 + i) if i % 4 == 3 else SamplingParams()
        out.append((prompt, GenerationConfig(max_new_tokens=rng.randint(4, 12), sampling=sp, ignore_eos=True)))
    return out


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
@pytest.mark.parametrize(
    "prefill_chunk,native,lo,hi,drafter",
    [(8, False, 12, 40, True), (256, True, 66, 100, True), (8, False, 12, 40, False)],
)
def test_batched_with_prefix_cache_equals_alone(prefill_chunk, native, lo, hi, drafter) -> None:
    """Requests that reuse cached prompt prefixes (whole or chunk-aligned) give their solo tokens, and skip those rows."""
    model = native_tiny(3)
    engine = Engine(model)
    reqs = _shared_prefix_requests(11, lo, hi)
    d = HashDrafter() if drafter else None
    solo = [
        run_alone(engine, p, c, drafter=d, step_rows=8, prefill_chunk=prefill_chunk, native_prefill=native)
        for p, c in reqs
    ]
    sched = Scheduler(engine, 8, prefill_chunk, native_prefill=native, prefix_cache_bytes=64 << 20)
    assert sched.prefix_cache.chunk_rows == (1 if native else 8)  # native prefill is row-invariant
    rows_in = 0
    for wave in (reqs[:3], reqs[3:]):  # the first wave fills the cache, the second reuses it
        handles = {sched.add(p, c, d, GenerationStats()): i for i, (p, c) in enumerate(reqs) if (p, c) in wave}
        out: dict[int, list[int]] = {i: [] for i in handles.values()}
        while sched.active:
            for req, new in sched.step():
                assert req.error is None, req.error
                out[handles[req]] += new
            rows_in += sched.last_step.prefill_rows
            for req in [r for r in sched.active if r.done]:
                sched.remove(req)
        for i, toks in out.items():
            assert toks == solo[i], f"request {i}"
    pc = sched.prefix_cache
    assert pc.hits == 3  # requests 3-5 repeat 0-2 whole
    assert pc.partial_hits == 3  # requests 6-8 share all but their last 5 tokens with 0-2
    assert rows_in == sum(len(p) for p, _ in reqs) - pc.reused_tokens  # reused rows never ran


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_whole_prompt_hit_draws_its_first_token_without_a_forward() -> None:
    model = native_tiny(4)
    sched = Scheduler(Engine(model), 8, 16, prefix_cache_bytes=16 << 20)
    prompt, cfg = list(range(1, 30)), GenerationConfig(max_new_tokens=1, ignore_eos=True)
    first = sched.add(prompt, cfg, None)
    while not first.done:
        sched.step()
    sched.remove(first)
    again = sched.add(prompt, cfg, None)
    assert again.prefilled == len(prompt) and again.cache.length == len(prompt)
    events = sched.step()
    assert events == [(again, first.output())] and sched.last_step.rows == 0 and again.done


@pytest.mark.skipif(not kernels.bf16_scores_supported(), reason="needs a native build with AVX512-BF16")
def test_entries_are_kept_apart_by_the_models_attention_score_mode() -> None:
    """A prefill computed with float32 scores is never reused once the model is switched to bf16 scores (and back)."""
    from native_utils import tiny_native_hd32

    model = tiny_native_hd32(96)
    engine = Engine(model)
    sched = Scheduler(engine, 8, 16, native_prefill=True, prefix_cache_bytes=16 << 20)
    prompt, cfg = list(range(1, 41)), GenerationConfig(max_new_tokens=12, ignore_eos=True)

    def run() -> list[int]:
        req = sched.add(prompt, cfg, None)
        while not req.done:
            sched.step()
        sched.remove(req)
        return req.output()

    fp32 = run()
    model.bf16_scores = True
    bf16 = run()
    assert sched.prefix_cache.hits == 0  # the float32 entry was not reused
    assert bf16 == run_alone(engine, prompt, cfg, step_rows=8, prefill_chunk=16, native_prefill=True)
    assert run() == bf16 and sched.prefix_cache.hits == 1  # the bf16 entry is reused by the next bf16 request
    model.bf16_scores = False
    assert run() == fp32 and sched.prefix_cache.hits == 2
