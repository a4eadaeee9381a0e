"""Tiny seeded models on the native q4 linears (row-invariant, exact attention on), shared by the tests."""

from __future__ import annotations

import warnings

import torch

from treedraft import kernels
from treedraft.models.llama import Linear, LlamaConfig, Transformer
from treedraft.models.quant import quantize_q4_rtn, swap_linears


def make_native(model: Transformer) -> Transformer:
    """Swap every Linear of ``model`` for a native q4 linear (round-to-nearest), as load(weights='int4') does."""
    qw = {n: quantize_q4_rtn(m.weight.detach()) for n, m in model.named_modules() if isinstance(m, Linear)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pack: .* is stored as fp16")  # random weights: fp16 scales round
        swap_linears(model, qw, {"q4": "native"}, kernels)
    return model


def tiny_config(max_seq_len: int, vocab_size: int = 64) -> LlamaConfig:
    """2 layers, hidden 64, 4 heads over 2 kv heads (GQA)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        max_seq_len=max_seq_len,
    )  # fmt: skip


def tiny_native(max_seq_len: int, seed: int = 0) -> Transformer:
    """A tiny seeded model (:func:`tiny_config`) with every linear native q4."""
    torch.manual_seed(seed)
    return make_native(Transformer(tiny_config(max_seq_len)).eval())


def tiny_native_hd32(max_seq_len: int, seed: int = 0) -> Transformer:
    """A tiny seeded native q4 model with head_dim 32 (hidden 128, 4 heads over 2 kv heads): bf16 attention scores
    need hd % 32 == 0, which :func:`tiny_native`'s 16 is not."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_seq_len=max_seq_len)  # fmt: skip
    return make_native(Transformer(cfg).eval())


def chain_steps(model: Transformer, prompt: torch.Tensor, chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-norm hidden states of ``chain`` after ``prompt``: decoded one token a step, and verified as one tree step
    (a causal chain); (plain (n, H), tree (n, H)). Each on a fresh cache after the same prefill."""
    p, n = len(prompt), len(chain)
    with torch.inference_mode():
        c1 = model.new_cache(max_len=p + n)
        model(prompt[None], torch.arange(p), c1, start=0)
        plain = torch.stack(
            [model(chain[i : i + 1][None], torch.tensor([p + i]), c1, start=p + i)[1][0, 0] for i in range(n)]
        )
        c2 = model.new_cache(max_len=p + n)
        model(prompt[None], torch.arange(p), c2, start=0)
        tree = model(chain[None], torch.arange(p, p + n), c2, start=p)[1][0]
    return plain, tree


def count_native(monkeypatch) -> dict[str, int]:
    """Counts the forwards that ran in the native fused decoder (a spy on fused.forward_segments): ``{"fused": n}``."""
    from treedraft.models import fused

    n = {"fused": 0}
    real = fused.forward_segments

    def spy(*a, **k):
        out = real(*a, **k)
        n["fused"] += out is not None
        return out

    monkeypatch.setattr(fused, "forward_segments", spy)
    return n


# llama.cpp's converter's tensor names for a Llama-style layer with q/k head norms (Qwen3; write_converted_gguf)
QK_NORM_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma 3's sandwich norms: the post-attention norm has its own name, the FFN's input norm is ffn_norm
GEMMA3_GGUF_NAMES = QK_NORM_GGUF_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_converted_gguf(
    path, arch: str, hf, names: dict[str, str], norm_offset: float = 0.0, rope_base: float = 1e6, extra=None
) -> None:
    """A tiny transformers model as llama.cpp's converter writes it for ``arch`` (no q/k permutation: not "llama"):
    the common header from its config, float32 tensors, ``names`` mapping each layer's HF tensor to the GGUF one,
    ``norm_offset`` added to every RMSNorm weight (1.0 for Gemma, which stores 1 + w); ``extra(writer)`` adds keys."""
    import gguf

    c = hf.config
    assert c.tie_word_embeddings, "write_converted_gguf writes no output.weight: tied embeddings only"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_context_length(128)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if extra is not None:
        extra(w)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", norm_offset + sd["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, g_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            w.add_tensor(f"blk.{i}.{g_name}.weight", norm_offset + t if g_name.endswith("norm") else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
