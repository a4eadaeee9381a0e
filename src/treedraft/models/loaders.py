"""Weight loaders into the own Llama module: GGUF files and Hugging Face directories.

Every tensor goes through an explicit key map with a shape assert; a tensor
the map does not know, or a missing one, is an error (nothing silently dropped).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .errors import ModelLoadError
from .gguf_meta import read_gguf_meta
from .llama import LlamaConfig, Transformer, rope_frequencies

LLAMA_ARCHS = {"llama", "qwen2", "qwen3", "mistral"}  # qwen3: Qwen2's decoder with q/k head norms, no biases
GEMMA_ARCHS = {"gemma3", "gemma3_text"}  # Gemma 3's GGUF architecture and its Hugging Face text-only model_type
OWN_GGUF_ARCHS = LLAMA_ARCHS | {"gemma3"}  # GGUF general.architecture values the own runtime loads
OWN_HF_TYPES = LLAMA_ARCHS | {"gemma3_text"}  # config.json model_type values it loads ("gemma3" there: multimodal)


HF_HINT = "--runtime hf (runtime='hf' in Python)"


def own_runtime_loads(arch: str, is_dir: bool) -> bool:
    """Whether the own runtime loads a model of this architecture (a GGUF's, or an HF directory's model_type)."""
    return arch in (OWN_HF_TYPES if is_dir else OWN_GGUF_ARCHS)


__all__ = [
    "GEMMA_ARCHS",
    "LLAMA_ARCHS",
    "OWN_GGUF_ARCHS",
    "OWN_HF_TYPES",
    "ModelLoadError",
    "from_state_dict",
    "gguf_config",
    "hf_config",
    "load_gguf",
    "load_hf_dir",
    "own_runtime_loads",
]
GEMMA3_LOCAL_THETA = 10000.0  # Gemma 3's local layers' RoPE base (transformers' default; not in the GGUF header)
GEMMA3_PATTERN = 6  # every 6th layer is global, the others local (sliding window)


def gemma3_local_layers(layers: int, pattern: int = GEMMA3_PATTERN) -> tuple[int, ...]:
    """The local (sliding-window) layers: all but every ``pattern``-th."""
    return tuple(i for i in range(layers) if (i + 1) % pattern)


def gemma3_fields(
    hidden: int, head_dim: int, window: int | None, local: tuple[int, ...], scalar: float, theta_local: float
) -> dict:
    """LlamaConfig fields of a Gemma 3 text decoder (``scalar``: query_pre_attn_scalar; ``local``: its local layers,
    ``theta_local`` their RoPE base)."""
    return dict(
        head_dim_override=head_dim,
        embed_scale=hidden**0.5,
        qk_norm=True,
        sandwich_norm=True,
        activation="gelu_tanh",
        attn_scale=scalar**-0.5,
        sliding_window=window,
        local_layers=local,
        rope_theta_local=theta_local,
    )


def gguf_config(path: str | Path, max_seq_len: int | None = None) -> tuple[LlamaConfig, dict]:
    """Read a :class:`LlamaConfig` and tokenizer metadata from a GGUF header (cached: see gguf_meta)."""
    h = read_gguf_meta(path)
    arch = h.architecture
    if arch not in OWN_GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported by the own runtime "
            f"(supported: {sorted(OWN_GGUF_ARCHS)}); load it through transformers: {HF_HINT}"
        )

    def need(name: str) -> int:
        v = h.arch_get(name)
        if v is None:
            raise ModelLoadError(f"{path}: the GGUF header lacks {arch}.{name}; re-convert the model")
        return int(v)

    names = {t.name for t in h.tensors}
    n_heads = need("attention.head_count")
    ctx = h.context_length or 2048
    if h.vocab_size is None:
        raise ModelLoadError(f"{path}: the GGUF header has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    extra: dict = {}
    if arch in GEMMA_ARCHS:
        hidden, layers, hd = need("embedding_length"), need("block_count"), need("attention.key_length")
        window = h.arch_get("attention.sliding_window")
        # llama.cpp's attention scale for Gemma 3: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B (62 layers)
        scalar = hidden / n_heads if layers == 62 else hd
        window = None if window is None else int(window)
        extra = gemma3_fields(hidden, hd, window, gemma3_local_layers(layers), scalar, GEMMA3_LOCAL_THETA)
    kind = h.arch_get("rope.scaling.type")  # e.g. YaRN in long-context Qwen3 files: refused, never dropped
    if kind not in (None, "none"):
        factor = h.arch_get("rope.scaling.factor")
        if kind != "linear" or factor is None:
            raise ModelLoadError(
                f"{path}: rope scaling {kind!r} (factor {factor}) is not supported by the own runtime (linear with a "
                f"factor is); load it through transformers: {HF_HINT}"
            )
        extra["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    kl, vl = h.arch_get("attention.key_length"), h.arch_get("attention.value_length")
    if kl is not None and vl is not None and int(kl) != int(vl):
        raise ModelLoadError(
            f"{path}: key length {kl} != value length {vl}: not supported by the own runtime; {HF_HINT}"
        )
    if kl is not None and int(kl) != need("embedding_length") // n_heads:  # Qwen3, Gemma 3, Mistral-Nemo
        extra.setdefault("head_dim_override", int(kl))
    head_dim = extra.get("head_dim_override") or need("embedding_length") // n_heads
    rot = h.arch_get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(
            f"{path}: RoPE on {rot} of {head_dim} head dimensions (partial rotary) is not supported by the own runtime; "
            f"{HF_HINT}"
        )
    if arch == "qwen3":
        extra["qk_norm"] = True
    cfg = LlamaConfig(
        vocab_size=h.vocab_size,
        hidden_size=need("embedding_length"),
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=n_heads,
        num_kv_heads=int(h.arch_get("attention.head_count_kv", n_heads)),
        max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx,
        rope_theta=float(h.arch_get("rope.freq_base", 10000.0)),
        rms_eps=float(h.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        **extra,
    )
    tok = h.tokenizer
    meta = {
        "architecture": arch,
        "name": h.get("general.name"),
        "chat_template": tok["chat_template"],
        "bos_token_id": tok["bos_token_id"],
        "eos_token_id": tok["eos_token_id"],
    }
    return cfg, meta


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope -> HF rotate-half rows)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", max_seq_len: int | None = None
) -> tuple[Transformer, dict]:
    """Dequantize a Llama-family GGUF file into the own :class:`Transformer`."""
    path = Path(path)
    cfg, meta = gguf_config(path, max_seq_len)
    raw = {t.name: a for t, a in read_gguf_meta(path).dequantized()}  # name -> float32 (rows, cols)
    if meta["architecture"] == "llama":  # only llama-arch GGUFs carry permuted q/k rows
        for i in range(cfg.num_layers):
            raw[f"blk.{i}.attn_q.weight"] = _unpermute_rope(raw[f"blk.{i}.attn_q.weight"], cfg.num_heads)
            raw[f"blk.{i}.attn_k.weight"] = _unpermute_rope(raw[f"blk.{i}.attn_k.weight"], cfg.num_kv_heads)
    keymap = {
        "token_embd.weight": "embed",
        "output_norm.weight": "norm",
        "output.weight": "lm_head",
        "attn_q": "q",
        "attn_k": "k",
        "attn_v": "v",
        "attn_output": "o",
        "attn_norm": "attn_norm",
        "ffn_norm": "ffn_norm",
        "ffn_gate": "gate",
        "ffn_up": "up",
        "ffn_down": "down",
        # Qwen3 and Gemma 3 (llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w already)
        "attn_q_norm": "q_norm",
        "attn_k_norm": "k_norm",
        "post_attention_norm": "post_attn_norm",
        "post_ffw_norm": "post_ffn_norm",
    }
    canon: dict[str, np.ndarray] = {}
    for name, arr in raw.items():
        if name.startswith("blk."):
            _, i, part, kind = name.split(".")
            if part not in keymap:
                raise ModelLoadError(f"{path}: unknown tensor {name!r}")
            canon[f"{i}.{keymap[part]}.{kind}"] = arr
        elif name in keymap:
            canon[keymap[name] + ".weight"] = arr
        elif name == "rope_freqs.weight":
            raise ModelLoadError(f"{path}: rope_freqs tensors (Llama-3.1 scaling in GGUF) are not supported yet")
        else:
            raise ModelLoadError(f"{path}: unknown tensor {name!r}")
    model = _build(cfg, canon, str(path), dtype, device)
    return model, meta


def hf_config(d: Path, max_seq_len: int | None = None) -> LlamaConfig:
    """Read a :class:`LlamaConfig` from a Hugging Face ``config.json``."""
    c = json.loads((d / "config.json").read_text())
    arch = c.get("model_type")
    if arch == "gemma3_text":
        return _gemma3_hf_config(d, c, max_seq_len)
    if arch not in LLAMA_ARCHS:
        raise ModelLoadError(
            f"{d}: model_type {arch!r} not supported by the own runtime "
            f"(supported: {sorted(OWN_HF_TYPES)}); load it through transformers: {HF_HINT}"
        )
    ctx = int(c.get("max_position_embeddings", 2048))
    # rope scaling: "rope_scaling" (transformers < 5) or "rope_parameters" (what transformers 5 writes)
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(
            f"{d}: rope scaling {rope_type!r} is not supported by the own runtime (default and llama3 are); {HF_HINT}"
        )
    if arch == "qwen3" and c.get("attention_bias"):
        raise ModelLoadError(
            f"{d}: Qwen3 with attention biases (o_proj's too) is not supported by the own runtime; {HF_HINT}"
        )
    window = c.get("sliding_window") if (arch == "mistral" or c.get("use_sliding_window")) else None
    if window:  # no sliding-window attention here: within the window it is plain causal attention
        ctx = min(ctx, int(window))
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx,
        rope_theta=float(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_eps=float(c.get("rms_norm_eps", 1e-6 if arch == "qwen3" else 1e-5)),  # transformers' defaults
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        head_dim_override=c.get("head_dim", 128 if arch == "qwen3" else None),
        rope_scaling=dict(rope) if rope_type == "llama3" else None,
    )


def _gemma3_hf_config(d: Path, c: dict, max_seq_len: int | None) -> LlamaConfig:
    """A Gemma 3 text model's ``config.json`` (transformers' Gemma3TextConfig) as a :class:`LlamaConfig`."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ModelLoadError(f"{d}: {key} is not supported by the own runtime; {HF_HINT}")
    if c.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{d}: bidirectional attention is not supported by the own runtime; {HF_HINT}")
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{d}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh is); {HF_HINT}")
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types:
        local_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        local_layers = gemma3_local_layers(n, int(c.get("sliding_window_pattern", GEMMA3_PATTERN)))
    # rope: transformers 5 writes {"full_attention": {...}, "sliding_attention": {...}}; older configs rope_theta,
    # rope_local_base_freq and rope_scaling
    rp = c.get("rope_parameters") or {}
    full = rp.get("full_attention") or {"rope_theta": c.get("rope_theta", 1_000_000.0), **(c.get("rope_scaling") or {})}
    local = rp.get("sliding_attention") or {"rope_theta": c.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)}
    for name, r in (("full_attention", full), ("sliding_attention", local)):
        kind = r.get("rope_type", r.get("type", "default"))
        bad = kind not in ("default", "linear") or (name == "sliding_attention" and kind != "default")
        if bad or "rope_theta" not in r or (kind == "linear" and "factor" not in r):
            raise ModelLoadError(f"{d}: rope {r} on the {name} layers is not supported by the own runtime; {HF_HINT}")
    kind = full.get("rope_type", full.get("type", "default"))
    hd = int(c.get("head_dim", 256))
    ctx = int(c.get("max_position_embeddings", 32768))
    scalar = float(c.get("query_pre_attn_scalar", hd))
    fields = gemma3_fields(
        int(c["hidden_size"]), hd, c.get("sliding_window"), local_layers, scalar, float(local["rope_theta"])
    )
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=n,
        num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx,
        rope_theta=float(full["rope_theta"]),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        qkv_bias=bool(c.get("attention_bias", False)),
        rope_scaling={"rope_type": "linear", "factor": float(full["factor"])} if kind == "linear" else None,
        **fields,
    )


def load_hf_dir(
    d: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", max_seq_len: int | None = None
) -> Transformer:
    """Load a Hugging Face directory (config.json + *.safetensors) into the own module."""
    from safetensors.numpy import load_file

    d = Path(d)
    if not (d / "config.json").is_file():
        raise ModelLoadError(f"{d}: no config.json; expected a Hugging Face model directory")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d}: no *.safetensors files")
    cfg = hf_config(d, max_seq_len)
    canon: dict[str, np.ndarray] = {}
    part = {
        "self_attn.q_proj": "q",
        "self_attn.k_proj": "k",
        "self_attn.v_proj": "v",
        "self_attn.o_proj": "o",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "gate",
        "mlp.up_proj": "up",
        "mlp.down_proj": "down",
    }
    if cfg.qk_norm:  # Qwen3, Gemma 3
        part |= {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
    gemma = cfg.sandwich_norm
    if gemma:  # Gemma 3: post_attention_layernorm is the attention output's norm; every RMSNorm scales by 1 + w
        part |= {
            "post_attention_layernorm": "post_attn_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffn_norm",
        }
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    for f in files:
        for name, arr in load_file(str(f)).items():
            if name in top:
                canon[top[name]] = arr.astype(np.float32)
                continue
            bits = name.split(".")
            if bits[:2] != ["model", "layers"] or ".".join(bits[3:-1]) not in part:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # derived buffer, recomputed from config
                raise ModelLoadError(f"{f}: unknown tensor {name!r}")
            canon[f"{bits[2]}.{part['.'.join(bits[3:-1])]}.{bits[-1]}"] = arr.astype(np.float32)
    if gemma:  # as transformers' Gemma3RMSNorm: x * (1 + w), with 1 + w in float32
        for k in [k for k in canon if k.endswith("norm.weight")]:
            canon[k] = np.float32(1.0) + canon[k]
    if cfg.tie_embeddings:
        canon.pop("lm_head.weight", None)
    return _build(cfg, canon, str(d), dtype, device)


def from_state_dict(cfg: LlamaConfig, sd: dict[str, Tensor], src: str, dtype: torch.dtype, device: str) -> Transformer:
    """A frozen Transformer from its own state dict (lm_head may be absent when embeddings are tied)."""
    with torch.device("meta"):
        model = Transformer(cfg, init=False)
    # assign: the module takes the state dict's tensors as its parameters (no allocation and copy of the
    # meta-device model first: to_empty alone took 0.7 s for SmolLM2 through torch's Python reference ops)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    real_missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if real_missing or unexpected:
        raise ModelLoadError(f"{src}: state dict mismatch, missing={real_missing[:8]} unexpected={unexpected[:8]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_frequencies(cfg)  # non-persistent buffers: not in the state dict
    model.inv_freq_local = rope_frequencies(cfg, local=True) if cfg.local_layers else None
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{src}: no values for {left[:8]}")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _build(cfg: LlamaConfig, canon: dict[str, np.ndarray], src: str, dtype: torch.dtype, device: str) -> Transformer:
    """Fill a fresh Transformer from canonical names ``{i}.{q,k,v,o,...}.{weight,bias}``."""
    hd, H = cfg.head_dim, cfg.hidden_size
    sd: dict[str, Tensor] = {}

    def take(key: str, shape: tuple[int, ...]) -> Tensor:
        if key not in canon:
            raise ModelLoadError(f"{src}: missing tensor {key!r}")
        t = torch.from_numpy(np.ascontiguousarray(canon.pop(key)))
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{src}: tensor {key!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    sd["embed.weight"] = take("embed.weight", (cfg.vocab_size, H))
    sd["norm.weight"] = take("norm.weight", (H,))
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = take("lm_head.weight", (cfg.vocab_size, H))
    qo, kvo = cfg.num_heads * hd, cfg.num_kv_heads * hd
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        sd[p + "attn_norm.weight"] = take(f"{i}.attn_norm.weight", (H,))
        sd[p + "ffn_norm.weight"] = take(f"{i}.ffn_norm.weight", (H,))
        if cfg.qk_norm:
            sd[p + "attn.q_norm.weight"] = take(f"{i}.q_norm.weight", (hd,))
            sd[p + "attn.k_norm.weight"] = take(f"{i}.k_norm.weight", (hd,))
        if cfg.sandwich_norm:
            sd[p + "post_attn_norm.weight"] = take(f"{i}.post_attn_norm.weight", (H,))
            sd[p + "post_ffn_norm.weight"] = take(f"{i}.post_ffn_norm.weight", (H,))
        sd[p + "attn.wqkv.weight"] = torch.cat(
            [take(f"{i}.q.weight", (qo, H)), take(f"{i}.k.weight", (kvo, H)), take(f"{i}.v.weight", (kvo, H))]
        )
        if cfg.qkv_bias:
            sd[p + "attn.wqkv.bias"] = torch.cat(
                [take(f"{i}.q.bias", (qo,)), take(f"{i}.k.bias", (kvo,)), take(f"{i}.v.bias", (kvo,))]
            )
        sd[p + "attn.wo.weight"] = take(f"{i}.o.weight", (H, qo))
        sd[p + "ffn.w13.weight"] = torch.cat(
            [take(f"{i}.gate.weight", (cfg.intermediate_size, H)), take(f"{i}.up.weight", (cfg.intermediate_size, H))]
        )
        sd[p + "ffn.w2.weight"] = take(f"{i}.down.weight", (H, cfg.intermediate_size))
    if canon:
        raise ModelLoadError(f"{src}: tensors not used by the model: {sorted(canon)[:8]}")
    return from_state_dict(cfg, sd, src, dtype, device)
