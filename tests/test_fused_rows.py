"""Fused decoder row passes at a real hidden size (kernels/fused.h rows(), mm_core.h quantize_row): at
SmolLM2's widths (576 hidden, 1536 intermediate) a many-row step can run its norms, RoPE, cache writes,
silu and activation quantization (16 blocks at a time) over the thread pool; a 1-row step runs them on
the caller. Every row must keep its bits whatever the thread count, the row count and the path taken.
The pool row passes are off by default (kernels.set_row_pass_blocks): these tests turn them on."""

from __future__ import annotations

import warnings

import pytest
import torch

from treedraft import kernels
from treedraft.models import fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")

V = 128


def _model():
    """Two seeded layers shaped like SmolLM2-135M (576 = 18 blocks, 1536 = 48 blocks), q4 layers, q8 head."""
    from treedraft.models.llama import Linear, LlamaConfig, Transformer
    from treedraft.models.quant import quantize_q4_rtn, quantize_q8_rtn, swap_linears

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        max_seq_len=256,
        tie_embeddings=False,
    )
    model = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    qw = {
        n: (quantize_q8_rtn if n == "lm_head" else quantize_q4_rtn)(m.weight.detach())
        for n, m in model.named_modules()
        if isinstance(m, Linear)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 rounding of the rtn scales
        swap_linears(model, qw, {"q4": "native", "q8": "native"}, kernels)
    return model


def _prefill(model, prompt: torch.Tensor):
    cache = model.new_cache(max_len=256)
    model(prompt[None], torch.arange(len(prompt)), cache, start=0)
    cache.keep(0, range(len(prompt)))
    return cache


def _chain_mask(n: int, start: int) -> torch.Tensor:
    """A 16-row step as two interleaved chains (rows 0, 2, 4, ... and 1, 3, 5, ...): (n, start + n) bool."""
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for i in range(n):
        mask[i, start + (i % 2) : start + i + 1 : 2] = True
    return mask


@pytest.fixture
def row_passes_on_pool():
    """Row passes of >= 64 blocks over the pool (default: all on the caller); restored afterwards."""
    old = kernels.set_row_pass_blocks(64)
    yield
    kernels.set_row_pass_blocks(old)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_many_row_step_equals_one_row_steps_and_thread_counts(
    kv_dtype: torch.dtype, monkeypatch, row_passes_on_pool
) -> None:
    """16 rows (pool row passes at 2 threads) == the same rows as 1-row steps (caller only) == 16 rows with
    every row pass on the caller, bit for bit, at 1 and 2 threads; the cache slots written by the row
    passes equal the 1-row steps' ones."""
    model = _model()
    model.kv_dtype = kv_dtype
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    assert fused.status(model) is None
    g = torch.Generator().manual_seed(3)
    P, n = 40, 16
    prompt, toks = torch.randint(0, V, (P,), generator=g), torch.randint(0, V, (n,), generator=g)
    pos = torch.tensor([P + i // 2 for i in range(n)])
    out = {}
    try:
        for key, threads, blocks in ((2, 2, 64), (1, 1, 64), ("caller", 2, None)):
            kernels.set_num_threads(threads)
            kernels.set_row_pass_blocks(blocks)
            with torch.inference_mode():
                cache = _prefill(model, prompt)
                lt, ht = model(toks[None], pos, cache, start=P, mask=_chain_mask(n, P))
                out[key] = (lt, ht, [c[:, :, P : P + n].clone() for c in cache.k + cache.v])
        kernels.set_row_pass_blocks(64)
        kernels.set_num_threads(2)
        with torch.inference_mode():
            for chain in (0, 1):
                cache = _prefill(model, prompt)
                for d, node in enumerate(range(chain, n, 2)):
                    l1, h1 = model(toks[None, node : node + 1], torch.tensor([P + d]), cache, start=P + d)
                    assert torch.equal(l1[0, 0], out[2][0][0, node]), node
                    assert torch.equal(h1[0, 0], out[2][1][0, node]), node
                    for c, ct in zip(cache.k + cache.v, out[2][2], strict=True):  # the row's own cache slot
                        assert torch.equal(c[:, :, P + d], ct[:, :, node])
    finally:
        kernels.set_num_threads(1)
    for key in (1, "caller"):
        assert all(torch.equal(a, b) for a, b in zip(out[key][:2], out[2][:2], strict=True)), key
        assert all(torch.equal(a, b) for a, b in zip(out[key][2], out[2][2], strict=True)), key


def test_many_row_step_close_to_python_path(monkeypatch, row_passes_on_pool) -> None:
    """The fused 16-row step stays within float rounding of the Python path (torch norms, RoPE, silu)."""
    model = _model()
    g = torch.Generator().manual_seed(4)
    P, n = 30, 16
    prompt, toks = torch.randint(0, V, (P,), generator=g), torch.randint(0, V, (n,), generator=g)
    res = {}
    kernels.set_num_threads(2)
    try:
        for use in ("0", "1"):
            monkeypatch.setenv(fused.ENV_DISABLE, use)
            with torch.inference_mode():
                res[use] = model(toks[None], torch.arange(P, P + n), _prefill(model, prompt), start=P)
    finally:
        kernels.set_num_threads(1)
    (lf, hf), (lp, hp) = res["0"], res["1"]
    torch.testing.assert_close(hf, hp, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lf, lp, atol=2e-2, rtol=2e-2)
