"""Python API: ``treedraft.load(...)`` -> :class:`LLM` with ``generate`` and ``stream``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine import Chunk, Drafter, Engine, GenerationConfig, GenerationError, GenerationResult
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
         device: str = "auto", dtype: str = "auto", runtime: str = "auto", max_seq_len: int | None = 4096,
         weights: str = "auto") -> LLM:
    """Load a target model by registry name, GGUF path or HF directory.

    drafter: 'default' (hybrid: Medusa heads + prompt lookup when heads are shipped for this model, else
    prompt lookup), a drafter name
    (see treedraft.drafters.DRAFTERS) or None for plain decoding.
    runtime: 'own' (compact Llama module), 'hf' (transformers adapter) or 'auto'.
    weights: 'fp32', 'int8', 'int4' (the GGUF's own 4-bit blocks) or 'auto' (the fastest measured on this
    machine whose quality check passes; see treedraft.models.quant_load). int4/int8: own runtime, cpu, fp32.
    """
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    path = resolve(model)
    from .models.loaders import LLAMA_ARCHS, ModelLoadError

    arch = _architecture(path)
    if runtime == "auto":
        runtime = "own" if arch in LLAMA_ARCHS else "hf"
    from .models.quant_load import resolve_weights  # --weights (issue 11): begin
    weights = resolve_weights(weights, runtime, dev, dt)  # end
    if runtime == "own":
        net, _meta = load_own(path, dt, dev, max_seq_len)
        if dev == "cpu" and weights in ("fp32", "auto"):  # int4/int8 replace every Linear (issue 11)
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
    if weights != "fp32":  # --weights (issue 11): swap in quantized linears; begin
        from .models.quant_load import PROBE_TEXT, apply_weights, log_stderr
        net.weights_info = apply_weights(net, path, weights, tok.encode(PROBE_TEXT), log=log_stderr)  # end
    llm = LLM(Engine(net, tok), tok, model if not Path(model).exists() else str(path), dev, heads)
    if drafter is not None:
        from .drafters import default_drafter
        llm.engine.drafter = default_drafter(llm, heads) if drafter == "default" else llm._drafter(drafter)
    return llm


def pack_tuned(net, path: Path, dtype: torch.dtype) -> None:  # noqa: ANN001
    """``net.pack()`` with its measured kernel plan cached per machine, torch, threads, model and dtype.

    Tuning takes a few seconds once; TREEDRAFT_RETUNE=1 forces a new measurement.
    """
    import hashlib
    import json
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    # v2: one entry per row count up to 16 and padded kernels (a v1 plan lacks rows 5, 7, 9, ...)
    key = hashlib.sha1(f"v2|{cpu}|{torch.__version__}|{torch.get_num_threads()}|{file_key(path)}|{dtype}".encode())
    f = cache_dir() / "tune" / f"{key.hexdigest()[:16]}.json"
    if f.is_file() and not os.environ.get("TREEDRAFT_RETUNE"):
        try:
            net.pack({int(k): v for k, v in json.loads(f.read_text()).items()})
            return
        except (ValueError, AttributeError):
            pass  # unreadable plan: measure again
    net.pack()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(net.matmul_plan))


def _architecture(path: Path) -> str:
    if path.is_dir():
        import json
        return json.loads((path / "config.json").read_text()).get("model_type", "?")
    return _gguf_architecture(path)


_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes


def _gguf_architecture(path: Path) -> str:
    """general.architecture from the GGUF header; a truncated or corrupt file raises ModelLoadError naming it."""
    import struct

    from .models.loaders import ModelLoadError

    try:
        return _read_gguf_architecture(path)
    except (struct.error, ValueError, EOFError, IndexError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: not a readable GGUF file (empty, truncated or corrupt: {e}); "
                             "re-download or re-convert it") from e


def _read_gguf_architecture(path: Path) -> str:
    """The header scan behind :func:`_gguf_architecture` (GGUFReader parses every field: ~20 s for a 262k vocab)."""
    import struct

    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic == b"GGUF" and version >= 2:
            _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
            for _ in range(min(n_kv, 32)):  # general.* keys come first; stop at the first array
                key = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")
                vtype = struct.unpack("<I", f.read(4))[0]
                if vtype == 8:  # string
                    val = f.read(struct.unpack("<Q", f.read(8))[0])
                    if key == "general.architecture":
                        return val.decode("utf-8", "replace")
                elif vtype in _GGUF_SCALAR_SIZES:
                    f.read(_GGUF_SCALAR_SIZES[vtype])
                else:
                    break
    import gguf
    fld = gguf.GGUFReader(str(path)).fields.get("general.architecture")
    return fld.contents() if fld is not None else "?"
