"""Python API: ``treedraft.load(...)`` -> :class:`LLM` with ``generate`` and ``stream``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine import Chunk, Drafter, Engine, GenerationConfig, GenerationError, GenerationResult
from .models.gguf_meta import model_architecture
from .models.plan import pack_tuned
from .models.registry import DEFAULT_MODEL, cache_dir, file_key, load_own, resolve
from .sampling import SamplingParams
from .tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def pick_device(device: str = "auto") -> str:
    """'auto' -> cuda when present, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda[:N]")
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' -> fp32 on cpu, bf16 on cuda."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return DTYPES[dtype]


@dataclass
class LLM:
    """A loaded target model + tokenizer + default drafter, ready to generate."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    device: str
    heads: str | None = "default"  # the heads argument of load(): used by drafters chosen by name later on
    _drafters: dict[str, Drafter | None] = field(default_factory=dict, repr=False)  # built by name, reused

    @property
    def model(self):  # noqa: ANN201
        return self.engine.model

    def encode_prompt(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Chat messages or a user string -> ids (chat template unless raw or no template)."""
        if isinstance(prompt, list):
            return self.tokenizer.apply_chat_template(prompt)
        if not isinstance(prompt, str):
            raise GenerationError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        if not prompt.strip():
            raise GenerationError("the prompt is empty; give some text")
        if raw or not self.tokenizer.is_chat:
            ids = self.tokenizer.encode(prompt)
            bos = getattr(self.tokenizer.hf, "bos_token_id", None)
            if getattr(self.tokenizer, "add_bos", False) and bos is not None:
                ids = [bos] + ids
            return ids
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    def config(self, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, stop: list[str] | tuple[str, ...] = (), rule: str = "speculative",
               max_tree_nodes: int = 64) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens,
                                sampling=SamplingParams(temperature, top_k, top_p, seed), rule=rule,
                                stop=tuple(stop), max_tree_nodes=max_tree_nodes)

    def _drafter(self, drafter: Drafter | str | None) -> Drafter | None:
        """'default' -> the engine's drafter; a name -> that drafter (built once, with the heads given to load())."""
        if drafter == "default":
            return self.engine.drafter
        if isinstance(drafter, str):
            if drafter not in self._drafters:
                from .drafters import make_drafter
                self._drafters[drafter] = make_drafter(drafter, self, self.heads)
            return self._drafters[drafter]
        return drafter

    def generate(self, prompt: str | list[dict], raw: bool = False, drafter: Drafter | str | None = "default",
                 **kw) -> GenerationResult:
        """Generate a whole answer. kw: see :meth:`config`."""
        return self.engine.generate(self.encode_prompt(prompt, raw), self.config(**kw), self._drafter(drafter))

    def stream(self, prompt: str | list[dict], raw: bool = False, drafter: Drafter | str | None = "default",
               stats=None, **kw) -> Iterator[Chunk]:  # noqa: ANN001
        """Yield chunks of text as they are produced."""
        return self.engine.stream(self.encode_prompt(prompt, raw), self.config(**kw), self._drafter(drafter), stats)


def load(model: str = DEFAULT_MODEL, drafter: str | None = "default", heads: str | None = "default",
         device: str = "auto", dtype: str = "auto", runtime: str = "auto", max_seq_len: int | None = 4096) -> LLM:
    """Load a target model by registry name, GGUF path or HF directory.

    drafter: 'default' (hybrid: Medusa heads + prompt lookup when heads are shipped for this model, else
    prompt lookup), a drafter name
    (see treedraft.drafters.DRAFTERS) or None for plain decoding.
    runtime: 'own' (compact Llama module), 'hf' (transformers adapter) or 'auto'.
    """
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    path = resolve(model)
    from .models.loaders import LLAMA_ARCHS, ModelLoadError

    arch = model_architecture(path)
    if runtime == "auto":
        runtime = "own" if arch in LLAMA_ARCHS else "hf"
    if runtime == "own":
        net, _meta = load_own(path, dt, dev, max_seq_len)
        if dev == "cpu":
            pack_tuned(net, path, dt)  # per-row-count matmul kernels, measured on this machine
    elif runtime == "hf":
        from .models.hf_adapter import HFTarget
        net = HFTarget.load(path, dt, dev, max_seq_len)
    else:
        raise ModelLoadError(f"unknown runtime {runtime!r}; use auto, own or hf")
    tok = (Tokenizer.from_gguf(path, cache_dir() / "tokenizers" / file_key(path)) if path.is_file()
           else Tokenizer.from_dir(path))
    if arch == "gemma3" and tok.hf.bos_token_id is not None:
        tok.add_bos = True  # Gemma expects <bos> in front of raw text
    llm = LLM(Engine(net, tok), tok, model if not Path(model).exists() else str(path), dev, heads)
    if drafter is not None:
        from .drafters import default_drafter
        llm.engine.drafter = default_drafter(llm, heads) if drafter == "default" else llm._drafter(drafter)
    return llm
