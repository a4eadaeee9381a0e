"""Adapter: any transformers ``AutoModelForCausalLM`` behind the target interface of models/llama.py.

The engine drives every target through ``new_cache`` / ``forward(tokens, positions, cache, start,
mask, logits_for)`` / ``cache.keep``. Here that is mapped onto a transformers model:

- positions go in as explicit ``position_ids``;
- the boolean (T, start+T) tree mask becomes a 4D *additive* float mask (0 = attend, dtype min =
  blocked), which both the ``eager`` (adds it to the scores) and ``sdpa`` attention paths honour and
  which transformers' mask builders return unchanged;
- sliding-window layers (Gemma 2/3, Qwen2, Mistral) get the window applied on top of our mask,
  measured in *positions* (query position - key position < window), so a tree stays correct past
  the window; hybrid models get a ``{layer_type: mask}`` dict as their modeling code expects;
- the KV cache is a transformers ``DynamicCache`` built *without* a config, i.e. plain full
  ``DynamicLayer`` s for every layer (a sliding-window cache layer would drop the slots that tree
  compaction and our masks index). :meth:`HFCache.keep` compacts ``layer.keys`` / ``layer.values``.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import torch
from torch import Tensor

from .loaders import ModelLoadError

_MASKABLE_ATTN = ("eager", "sdpa")  # implementations that apply an explicit 4D float mask
_LAYER_TYPES = ("full_attention", "sliding_attention")


class HFCache:
    """KV cache of an :class:`HFTarget`: a full-attention ``DynamicCache`` plus the position of every slot.

    ``length`` counts committed slots; a forward writes slots ``[start, start + T)`` (dropping any
    uncommitted slots at or after ``start`` first); :meth:`keep` compacts the chosen ones to ``start``.
    """

    def __init__(self, max_len: int, batch: int = 1, device: torch.device | str = "cpu") -> None:
        from transformers import DynamicCache

        self.hf = DynamicCache()  # no config: every layer a full DynamicLayer, never a sliding one
        self.max_len = max_len
        self.batch = batch
        self.length = 0
        self.stored = 0  # slots physically held (committed + last forward's uncommitted ones)
        self.pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # rotary position of each slot

    def _layers(self) -> list:
        return [layer for layer in self.hf.layers if getattr(layer, "is_initialized", False)]

    def crop(self, n: int) -> None:
        """Physically drop every slot at or after ``n``."""
        if n >= self.stored:
            return
        for layer in self._layers():
            layer.keys = layer.keys[:, :, :n]
            layer.values = layer.values[:, :, :n]
        self.stored = n
        self.length = min(self.length, n)

    def keep(self, start: int, indices: Tensor | list[int] | range) -> None:
        """Keep slots ``start + indices`` (in order) at ``start ...``; drop the rest; set length accordingly."""
        idx = torch.as_tensor(list(indices) if isinstance(indices, range) else indices, dtype=torch.long)
        idx = idx.reshape(-1).cpu()
        n = int(idx.numel())
        if n and (int(idx.min()) < 0 or start + int(idx.max()) >= self.stored):
            raise ValueError(
                f"keep({start}, ...): indices must lie in [0, {self.stored - start}), got {idx.tolist()[:8]}"
            )
        if start > self.stored:
            raise ValueError(f"keep: start {start} is beyond the {self.stored} slots held")
        contiguous = n == 0 or torch.equal(idx, torch.arange(n))
        if contiguous:
            self.crop(start + n)
        else:
            src = idx + start
            for layer in self._layers():
                s = src.to(layer.keys.device)
                # new tensors rather than in-place writes: works inside and outside inference_mode
                layer.keys = torch.cat((layer.keys[:, :, :start], layer.keys.index_select(2, s)), dim=2)
                layer.values = torch.cat((layer.values[:, :, :start], layer.values.index_select(2, s)), dim=2)
            self.pos = self.pos.clone()
            self.pos[:, start : start + n] = self.pos.index_select(1, src.to(self.pos.device))
            self.stored = start + n
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Forget everything at or after ``length``."""
        self.crop(length)
        self.length = min(self.length, length)


class HFTarget:
    """A transformers causal LM behind the engine's target interface (see models/llama.py)."""

    def __init__(self, model, max_seq_len: int | None = None) -> None:
        """Wrap an already-built ``*ForCausalLM`` (eval mode, no grad); switches attention to sdpa if needed."""
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
            raise TypeError(f"HFTarget wraps a transformers *ForCausalLM model, got {type(model).__name__}")
        self.hf = model.eval().requires_grad_(False)
        cfg = model.config.get_text_config(decoder=True)
        self.config = cfg
        impl = getattr(model.config, "_attn_implementation", None)
        # flash/flex kernels ignore a float 4D mask; sdpa cannot softcap attention logits (Gemma 2)
        want = "eager" if getattr(cfg, "attn_logit_softcapping", None) else impl if impl in _MASKABLE_ATTN else "sdpa"
        if impl != want:
            model.set_attn_implementation(want)
        ctx = int(getattr(cfg, "max_position_embeddings", 0) or 0) or (max_seq_len or 2048)
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.hidden_size = int(cfg.hidden_size)
        n = int(cfg.num_hidden_layers)
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if types is None:
            types = ["sliding_attention" if window else "full_attention"] * n
        bad = sorted(set(types) - set(_LAYER_TYPES))
        if bad:
            raise ModelLoadError(
                f"{type(model).__name__}: layer types {bad} are not supported by the transformers "
                f"adapter (supported: {list(_LAYER_TYPES)})"
            )
        if "sliding_attention" in types and not window:
            raise ModelLoadError(f"{type(model).__name__}: sliding-attention layers but no config.sliding_window")
        self.layer_types = tuple(types)
        self.sliding_window = int(window) if "sliding_attention" in types else None
        params = inspect.signature(model.forward).parameters
        # later 5.x releases renamed past_key_values -> cache (the old name is deprecated)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params

    # ---- construction -------------------------------------------------
    @classmethod
    def from_model(cls, model, max_seq_len: int | None = None) -> HFTarget:
        """Wrap an already-built transformers causal LM (e.g. a tiny random one in tests)."""
        return cls(model, max_seq_len)

    @classmethod
    def load(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", max_seq_len: int | None = None
    ) -> HFTarget:
        """Load a GGUF file (dequantized once, then cached as safetensors) or a Hugging Face directory."""
        path = Path(path)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path}: no config.json; expected a Hugging Face model directory")
            src = path
        elif path.is_file():
            src = _converted_gguf(path)
        else:
            raise ModelLoadError(f"{path}: no such file or directory")
        model = _from_pretrained(src, dtype=dtype)
        return cls(model.to(device), max_seq_len)

    # ---- interface ----------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def lm_head(self) -> torch.nn.Module:
        """The output projection (hidden -> vocab), e.g. for Medusa heads that reuse it."""
        return self.hf.get_output_embeddings()

    def input_embedding_weight(self) -> Tensor:
        """(V, H) input embedding matrix of the wrapped model."""
        return self.hf.get_input_embeddings().weight

    def output_projection_weight(self) -> Tensor:
        """(V, H) weight of the output projection."""
        return self.lm_head.weight

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> HFCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
        max_len = max_len or self.max_seq_len
        if max_len > self.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds the model's context window {self.max_seq_len}")
        return HFCache(max_len, batch, self.device)

    def __call__(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: HFCache | None = None,
        start: int | None = None,
        mask: Tensor | None = None,
        logits_for: Tensor | slice | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run new tokens through the model; same contract as :meth:`treedraft.models.llama.Transformer.forward`.

        tokens: (B, T) or (T,) ids; positions: (B, T) or (T,).
        cache/start: new keys/values go to slots [start, start+T) (start defaults to ``cache.length``);
            attention covers slots [0, start+T).
        mask: boolean (T, start+T) or (B, 1, T, start+T), True = may attend; None = causal.
        logits_for: optional index into T choosing which rows get logits.
        Returns logits (B, T', V) in float32 and final-norm hidden states (B, T, H).
        """
        dev = self.device
        tokens = tokens.to(dev)
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        positions = torch.as_tensor(positions, dtype=torch.long).to(dev)
        if positions.dim() == 1:
            positions = positions[None].expand(B, T)
        if tuple(positions.shape) != (B, T):
            raise ValueError(f"positions have shape {tuple(positions.shape)}, expected ({B}, {T}) or ({T},)")
        if cache is None:
            if start:
                raise ValueError("start > 0 needs a cache")
            start = 0
        else:
            start = cache.length if start is None else int(start)
            if cache.batch != B:
                raise ValueError(f"cache was built for batch {cache.batch}, got tokens for batch {B}")
            if start > cache.stored or start < 0:
                raise ValueError(f"start {start} is outside the {cache.stored} slots in the cache")
            if start + T > cache.max_len:
                raise ValueError(f"KV cache overflow: writing up to {start + T} > max_len {cache.max_len}")
            cache.crop(start)  # forget uncommitted slots from an earlier tree
        S = start + T
        allowed = self._allowed(mask, B, T, start, dev)  # (B|1, 1, T, S) bool
        kpos = positions if cache is None else torch.cat((cache.pos[:, :start], positions), dim=1)  # (B, S)
        attn = self._attention_masks(allowed, positions, kpos)

        kw = {
            "input_ids": tokens,
            "position_ids": positions,
            "attention_mask": attn,
            "use_cache": cache is not None,
            "output_hidden_states": True,
            "return_dict": True,
        }
        if cache is not None:
            kw[self._cache_kw] = cache.hf
        rows = None
        if logits_for is not None:
            rows = torch.arange(T, device=dev)[logits_for].reshape(-1)
            if self._has_logits_to_keep:
                kw["logits_to_keep"] = rows
        out = self.hf(**kw)
        logits, hidden = out.logits, out.hidden_states[-1]  # (B, T', V), (B, T, H) post final norm
        if rows is not None and not self._has_logits_to_keep:
            logits = logits[:, rows]
        if cache is not None:
            cache.pos[:, start:S] = positions
            cache.stored = S
            held = cache.hf.get_seq_length()
            if held != S:
                raise RuntimeError(
                    f"{type(self.hf).__name__} wrote {held} cache slots, expected {S}; "
                    "this model does not use the transformers Cache API the adapter relies on"
                )
        return logits.float(), hidden

    # ---- masks --------------------------------------------------------
    @staticmethod
    def _allowed(mask: Tensor | None, B: int, T: int, start: int, dev: torch.device) -> Tensor:
        """The boolean attention pattern (B|1, 1, T, start+T); None = causal over everything before."""
        S = start + T
        if mask is None:
            return torch.ones(T, S, dtype=torch.bool, device=dev).tril(start)[None, None]
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be boolean (True = may attend), got {mask.dtype}")
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4 or tuple(mask.shape[-2:]) != (T, S) or mask.shape[1] != 1 or mask.shape[0] not in (1, B):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({T}, {S}) or ({B}, 1, {T}, {S})")
        return mask.to(dev)

    def _attention_masks(self, allowed: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor | dict[str, Tensor]:
        """Additive float 4D mask(s) for the model: one tensor, or ``{layer_type: mask}`` for hybrid models."""
        masks = {}
        for kind in set(self.layer_types):
            a = allowed
            if kind == "sliding_attention":
                near = (qpos[:, :, None] - kpos[:, None, :]) < self.sliding_window  # (B, T, S)
                a = a & near[:, None]
            masks[kind] = torch.zeros(a.shape, dtype=self.dtype, device=a.device).masked_fill(
                ~a, torch.finfo(self.dtype).min
            )
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks


def _from_pretrained(src: Path, **kw):
    """``AutoModelForCausalLM.from_pretrained`` with a clear error for non-causal-LM directories."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(src))
    impl = "eager" if getattr(cfg.get_text_config(decoder=True), "attn_logit_softcapping", None) else "sdpa"
    try:
        return AutoModelForCausalLM.from_pretrained(str(src), attn_implementation=impl, **kw)
    except ValueError as e:
        raise ModelLoadError(f"{src}: transformers cannot load it as a causal LM ({e})") from e


def _converted_gguf(path: Path) -> Path:
    """Dequantize a GGUF file through transformers once; cache it as an HF directory (fp32 safetensors)."""
    from .cache import publish_dir, temp_sibling
    from .registry import cache_dir, file_key

    out = cache_dir() / "hf" / file_key(path)
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path}: transformers cannot load this GGUF file ({e})") from e
    # the weights are plain dequantized tensors now; drop the gguf "quantizer" (it blocks save_pretrained)
    # and its quantization_config (it would send the reload down the GGUF path again)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = temp_sibling(out)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if not publish_dir(tmp, out, "config.json"):
        raise OSError(f"could not move the converted model from {tmp} to {out}")
    return out
