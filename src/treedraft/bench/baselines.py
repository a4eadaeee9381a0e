"""Baseline methods outside treedraft's engine: transformers ``generate`` and llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .harness import BenchError, MethodOutput


@dataclass
class HFMethod:
    """transformers ``generate`` on a causal LM, optionally with its prompt-lookup decoding."""

    model: Any  # transformers PreTrainedModel
    max_new_tokens: int
    prompt_lookup_num_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids ``generate`` stops at (generation_config, else the model config)."""
        out: set[int] = set()
        for cfg in (getattr(self.model, "generation_config", None), getattr(self.model, "config", None)):
            e = getattr(cfg, "eos_token_id", None)
            out.update(int(t) for t in ([] if e is None else [e] if isinstance(e, int) else e))
            if out:
                break
        return frozenset(out)

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        """Run ``generate`` and return only the new tokens: up to and including the EOS it stops at (if any)."""
        import torch

        x = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        kw: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, attention_mask=torch.ones_like(x))
        if self.prompt_lookup_num_tokens:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        if self.temperature > 0:
            if self.seed is not None:
                torch.manual_seed(self.seed)
            kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # 0 = off
            if self.min_p > 0:
                kw["min_p"] = self.min_p
        else:
            kw.update(do_sample=False)
        with torch.inference_mode():
            out = self.model.generate(x, **kw)
        new = out[0, x.shape[1] :].tolist()
        return MethodOutput(new, None, "length" if len(new) >= self.max_new_tokens else "stop")


@dataclass
class LlamaCppMethod:
    """llama.cpp through ``llama-cpp-python`` on the GGUF itself (quantized weights: outputs differ)."""

    llama: Any  # llama_cpp.Llama
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0  # passed always: llama-cpp-python's own default is 0.05, not the bench's 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The id this method stops at."""
        return frozenset({int(self.llama.token_eos())})

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        """Stream tokens from ``Llama.generate`` until EOS (kept as the last token) or max_new_tokens."""
        eos = self.llama.token_eos()
        greedy = self.temperature <= 0
        if self.seed is not None:
            self.llama.set_seed(self.seed)
        out: list[int] = []
        reason = "length"
        for tok in self.llama.generate(
            list(prompt_ids),
            reset=True,
            temp=0.0 if greedy else self.temperature,
            top_k=1 if greedy else self.top_k,
            top_p=1.0 if greedy else self.top_p,
            min_p=0.0 if greedy else self.min_p,
            repeat_penalty=1.0,
        ):
            out.append(int(tok))
            if tok == eos:
                reason = "stop"
                break
            if len(out) >= self.max_new_tokens:
                break
        return MethodOutput(out, None, reason)


def load_hf_baseline(path: Path, dtype: Any, device: str) -> Any:
    """The same weights as a transformers ``AutoModelForCausalLM`` (GGUF dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    if path.is_file():
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.to(device).eval()


def llama_cpp_build() -> str | None:
    """The importable llama-cpp-python's version and the CPU features its llama.cpp was compiled with (e.g.
    "0.3.36: AVX AVX2 F16C FMA ..."), so a report says which build it compared against (an AVX2-only build put first
    on PYTHONPATH shadows a native one); None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info()
    info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    # "CPU : SSE3 = 1 | AVX2 = 1 | OPENMP = 1 | ..." -> the features set to 1
    on = [k.split(":")[-1].strip() for k, _, v in (f.partition("=") for f in info.split("|")) if v.strip() == "1"]
    return f"{getattr(llama_cpp, '__version__', '?')}: {' '.join(on) or info.strip()}"


def llama_cpp_method(name: str, model_path: Path, config: Any, pld_tokens: int, cache: dict) -> LlamaCppMethod:
    try:
        import llama_cpp
    except ImportError as e:
        raise BenchError(
            "llama-cpp-python is not installed (optional; `pip install llama-cpp-python` builds llama.cpp from source)"
        ) from e
    if not model_path.is_file():
        raise BenchError(f"llama.cpp needs a GGUF file; {model_path} is a directory")
    import torch

    kw: dict[str, Any] = dict(
        model_path=str(model_path), n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False, logits_all=False
    )
    if name == "llama.cpp-pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=pld_tokens)
    sp = config.sampling
    return LlamaCppMethod(
        llama_cpp.Llama(**kw), config.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, min_p=sp.min_p
    )
