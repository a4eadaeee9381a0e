"""Qwen3 on the own runtime: Qwen2's decoder with an RMSNorm on each head's q and k before RoPE and no biases.

A tiny seeded transformers Qwen3 (head_dim 16, not hidden / heads = 8; random q/k norm weights) loads from its
Hugging Face directory and from a GGUF written as llama.cpp's converter writes one (arch qwen3, no q/k
permutation), matches transformers through a tree, and with native int8 weights runs in the fused decoder (q/k
norms only: FusedDecoder.set_variant), where speculative decoding equals plain decoding.
"""

from __future__ import annotations

import pytest
import torch
from native_utils import QK_NORM_GGUF_NAMES, count_native, write_converted_gguf
from tree_walk import hf_logits

from treedraft.drafters import PromptLookupDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.models import fused
from treedraft.models.loaders import load_gguf, load_hf_dir
from treedraft.models.quant_load import apply_weights
from treedraft.tree import TokenTree, full_attention_mask, tree_positions

transformers = pytest.importorskip("transformers")

VOCAB = 96


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.25,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
    d = tmp_path_factory.mktemp("tiny_qwen3")
    hf.save_pretrained(str(d))
    return hf, d


@pytest.mark.parametrize("source", ["hf", "gguf"])
@torch.inference_mode()
def test_matches_transformers_through_a_tree(qwen3, source, tmp_path) -> None:
    hf, d = qwen3
    if source == "gguf":
        pytest.importorskip("gguf")
        rope = hf.config.rope_parameters["rope_theta"]
        write_converted_gguf(tmp_path / "q.gguf", "qwen3", hf, QK_NORM_GGUF_NAMES, rope_base=rope)
        own, _ = load_gguf(tmp_path / "q.gguf")
    else:
        own = load_hf_dir(d)
    c = own.config
    assert c.qk_norm and c.head_dim == 16 and not c.sandwich_norm and not c.qkv_bias and c.embed_scale is None
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    cache = own.new_cache(64)
    lp, _ = own.forward(torch.tensor([prompt]), torch.arange(12), cache, 0)
    torch.testing.assert_close(lp[0], hf_logits(hf, prompt), atol=2e-4, rtol=2e-4)
    cache.keep(0, range(12))
    tree = TokenTree.from_sequences(5, [[7, 8, 9], [13, 14]])
    lt, _ = own.forward(torch.tensor([tree.tokens]), tree_positions(tree, 12), cache, 12, full_attention_mask(tree, 12))
    for leaf in (3, 5):
        path = tree.path_to(leaf)
        ref = hf_logits(hf, prompt + [tree.tokens[i] for i in path])[12:]
        torch.testing.assert_close(lt[0, path], ref, atol=2e-4, rtol=2e-4)


@torch.inference_mode()
def test_native_q_k_norms_exact_and_speculative_equals_plain(qwen3, monkeypatch) -> None:
    hf, d = qwen3
    own = load_hf_dir(d)
    apply_weights(own, None, "int8")
    assert fused.status(own) is None  # q/k norms alone run in the fused decoder
    native = count_native(monkeypatch)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (9,), generator=g)
    tree = TokenTree.from_sequences(3, [[4, 5], [6, 7, 8]])
    toks, pos, mask = torch.tensor(tree.tokens)[None], tree_positions(tree, 9), full_attention_mask(tree, 9)
    out = {}
    for use in (True, False):
        monkeypatch.setenv(fused.ENV_DISABLE, "0" if use else "1")
        cache = own.new_cache(64)
        own(prompt[None], torch.arange(9), cache, 0)
        cache.keep(0, range(9))
        out[use] = own(toks, pos, cache, 9, mask)[0]
    assert native["fused"] == 1  # the first tree step went native, the second did not
    torch.testing.assert_close(out[True], out[False], atol=2e-3, rtol=2e-3)  # native ~ Python path
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    base = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = Engine(own).generate(base + base[:6], cfg, drafter=None)
    spec = Engine(own).generate(base + base[:6], cfg, drafter=PromptLookupDrafter())
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0
    assert native["fused"] > 1 + 32  # the decode steps ran natively


@torch.inference_mode()
def test_gguf_weights_quantized_from_the_file(qwen3, tmp_path) -> None:
    """--weights int8 on a qwen3 GGUF takes the file's tensors without llama's q/k row permutation."""
    hf, _ = qwen3
    pytest.importorskip("gguf")
    path = tmp_path / "q.gguf"
    write_converted_gguf(path, "qwen3", hf, QK_NORM_GGUF_NAMES, rope_base=hf.config.rope_parameters["rope_theta"])
    own, _ = load_gguf(path)
    seq = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(3))
    ref, _ = own(seq[None], torch.arange(16))
    apply_weights(own, path, "int8")
    q8, _ = own(seq[None], torch.arange(16))
    assert (q8.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (q8 - ref).abs().max() < 0.05 * ref.abs().max()


def test_gguf_headers_the_runtime_cannot_follow_are_refused(qwen3, tmp_path) -> None:
    """YaRN scaling (long-context Qwen3 files), partial rotary and key != value lengths: a clear error, never a
    silently different model; a linear factor is taken."""
    from treedraft.models.loaders import ModelLoadError, gguf_config

    gguf = pytest.importorskip("gguf")
    hf, _ = qwen3

    def write(name, extra):
        write_converted_gguf(tmp_path / name, "qwen3", hf, QK_NORM_GGUF_NAMES, extra=extra)
        return tmp_path / name

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)

    with pytest.raises(ModelLoadError, match="rope scaling 'yarn'.*--runtime hf"):
        gguf_config(write("yarn.gguf", yarn))
    assert gguf_config(write("lin.gguf", linear))[0].rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ModelLoadError, match="partial rotary"):
        gguf_config(write("rot.gguf", lambda w: w.add_rope_dimension_count(8)))
