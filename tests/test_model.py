"""Own runtime: parity with transformers on the real weights, cache behaviour, loaders, bad input."""

from __future__ import annotations

import json

import pytest
import torch

import treedraft
from treedraft.interfaces import GenerationError
from treedraft.models.llama import Transformer
from treedraft.models.loaders import ModelLoadError, load_hf_dir
from treedraft.models.registry import resolve
from treedraft.models.tiny import tiny_llama


@pytest.mark.slow
def test_parity_with_transformers_prefill_and_incremental(smollm, hf_smollm) -> None:
    """Logits of the own module equal LlamaForCausalLM's: a 60-token prompt, then 5 cached steps."""
    model: Transformer = smollm.model
    ids = smollm.encode_prompt(
        "Explain, in detail, how a hash map handles collisions and resizing. "
        "Give an example in Python and discuss the complexity of each operation."
    )
    assert len(ids) >= 50
    g = torch.Generator().manual_seed(0)
    steps = torch.randint(0, model.vocab_size, (5,), generator=g).tolist()
    full = torch.tensor([ids + steps])
    with torch.inference_mode():
        ref = hf_smollm(full).logits[0]  # (L, V) no cache, causal
        cache = model.new_cache(256)
        lo, _ = model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)
        cache.keep(0, range(len(ids)))
        assert (lo[0] - ref[: len(ids)]).abs().max() < 1e-3
        for i, t in enumerate(steps):  # single-token decode path (packed weights)
            pos = len(ids) + i
            lo, _ = model(torch.tensor([[t]]), torch.tensor([pos]), cache, pos)
            cache.keep(pos, [0])
            assert (lo[0, 0] - ref[pos]).abs().max() < 1e-3


@pytest.mark.parametrize("strategy", ["linear", "xwt", "wxt"])
def test_matmul_strategies_agree(strategy: str) -> None:
    from treedraft.models.llama import matmul

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 16, generator=g)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 16, generator=g)
        y = matmul(strategy, x, w, w.t().contiguous())
        assert y.shape == (rows, 48) and y.is_contiguous()
        torch.testing.assert_close(y, x @ w.t(), atol=1e-5, rtol=1e-5)


def test_packed_model_follows_its_plan_and_gives_the_same_logits() -> None:
    from treedraft.models.llama import MATMUL_BUCKETS

    m = tiny_llama(seed=4)
    toks = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.inference_mode():
        ref, _ = m(toks, torch.arange(7))
        for strategy in ("xwt", "wxt", "wxt@16", "linear@8"):  # "@p": rows zero-padded to p, then dropped
            m.pack({b: strategy for b in MATMUL_BUCKETS})
            assert m.layers[0].attn.wqkv.plan[1] == strategy
            got, _ = m(toks, torch.arange(7))
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            cache = m.new_cache(16)
            m(toks[:, :6], torch.arange(6), cache, 0)
            cache.keep(0, range(6))
            one, _ = m(toks[:, 6:], torch.tensor([6]), cache, 6)  # the single-row decode path
            torch.testing.assert_close(one[0, 0], ref[0, 6], atol=1e-4, rtol=1e-4)
        # "@p" really pads: the kernel sees p rows, the caller gets its own
        import treedraft.models.matmul as llama  # where planned_matmul looks matmul up

        seen = []
        real = llama.matmul
        m.pack({b: "wxt@16" for b in MATMUL_BUCKETS})
        llama.matmul = lambda s, x, w, wt: seen.append((s, x.shape[0])) or real(s, x, w, wt)
        try:
            out, _ = m(toks, torch.arange(7))
        finally:
            llama.matmul = real
        assert out.shape[1] == 7 and seen and all(c == ("wxt", 16) for c in seen)
        m.pack()  # measured plan: every bucket gets a known strategy
        assert set(m.matmul_plan) == set(MATMUL_BUCKETS)
        for rows, strategy in m.matmul_plan.items():
            name, _, pad = strategy.partition("@")
            assert name in ("linear", "xwt", "wxt") and (not pad or int(pad) >= rows), (rows, strategy)
        m.unpack()
        assert m.layers[0].ffn.w2.plan is None


def test_cache_keep_compacts_chosen_slots() -> None:
    m = tiny_llama(seed=5)
    cache = m.new_cache(32)
    with torch.inference_mode():
        m(torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.arange(6), cache, 0)
    k_before = cache.k[0][:, :, :6].clone()
    cache.keep(2, [1, 3])  # keep slots 3 and 5 at 2 and 3
    assert cache.length == 4
    torch.testing.assert_close(cache.k[0][:, :, 2], k_before[:, :, 3])
    torch.testing.assert_close(cache.k[0][:, :, 3], k_before[:, :, 5])
    torch.testing.assert_close(cache.k[0][:, :, :2], k_before[:, :, :2])
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, 30, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))


def test_hf_dir_loader_refuses_unknown_and_misshaped_tensors(tmp_path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 16,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "tie_word_embeddings": True,
            }
        )
    )
    good = {
        "model.embed_tokens.weight": torch.zeros(16, 8),
        "model.norm.weight": torch.ones(8),
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(8),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 8),
        "model.layers.0.self_attn.v_proj.weight": torch.zeros(4, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(8, 8),
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(16, 8),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16),
    }
    save_file(good, str(tmp_path / "model.safetensors"))
    assert load_hf_dir(tmp_path).config.num_layers == 1
    bad = dict(good, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 8)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="k.weight.*shape"):
        load_hf_dir(tmp_path)
    save_file(dict(good, extra=torch.zeros(1)), str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unknown tensor 'extra'"):
        load_hf_dir(tmp_path)


def test_unknown_model_lists_available_names() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        resolve("no-such-model")
    with pytest.raises(ModelLoadError, match="Available names"):
        treedraft.load("/no/such/file.gguf")


@pytest.mark.slow
def test_bad_generation_input_gets_clear_errors(smollm) -> None:
    with pytest.raises(GenerationError, match="empty"):
        smollm.generate("   ")
    with pytest.raises(GenerationError, match="max_new_tokens"):
        smollm.generate("hi", max_new_tokens=0)
    limit = smollm.model.max_seq_len
    with pytest.raises(GenerationError, match=f"context window is {limit}"):
        smollm.engine.generate([1] * (limit + 5))
    with pytest.raises(ValueError, match="temperature"):
        smollm.generate("hi", temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        smollm.generate("hi", top_p=0)


@pytest.mark.slow
def test_sampling_is_seeded_and_respects_stop_strings(smollm_int4) -> None:
    smollm = smollm_int4  # the sampling and stop-string layers are the same for every weight format
    a = smollm.generate("Name three fruits.", max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    b = smollm.generate("Name three fruits.", max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids
    plain = smollm.generate("Count from 1 to 10, separated by commas.", max_new_tokens=40)
    assert "5" in plain.text
    cut = smollm.generate("Count from 1 to 10, separated by commas.", max_new_tokens=40, stop=["5"])
    assert cut.finish_reason == "stop" and "5" not in cut.text
    assert plain.text.startswith(cut.text)
