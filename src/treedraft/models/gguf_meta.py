"""The one GGUF metadata reader: parsed once per file with the ``gguf`` package, cached on disk.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, so opening a
file costs seconds (10 s for SmolLM2's 49k vocabulary, 27 s for Gemma 3's 262k on this CPU). The
header is therefore parsed once per file (identity: :func:`~treedraft.models.cache.file_key`) and
its scalars, short arrays, array lengths and tensor table are stored as JSON under
``cache_dir()/gguf/``. Tensor data is then read straight from a memory map through that table, so
loading weights needs no second parse either.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .cache import atomic_write_text, cache_dir, file_key
from .errors import ModelLoadError

CACHE_VERSION = 1
SHORT_ARRAY = 64  # metadata arrays up to this many items are kept whole; longer ones (vocabularies) by length
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}  # types the gguf package hands out as typed arrays; the rest as uint8 block rows


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of a GGUF tensor table."""

    name: str
    type: str  # GGMLQuantizationType name: "F32", "Q4_1", "Q4_K", ...
    shape: tuple[int, ...]  # numpy order (rows first): GGUF's dims reversed
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFMeta:
    """A GGUF file's header: metadata fields, lengths of long arrays, tensor table."""

    path: str
    fields: dict[str, Any]  # scalars, strings and arrays of up to SHORT_ARRAY items
    array_lengths: dict[str, int]  # every array field -> its number of items
    tensors: tuple[GGUFTensor, ...]

    @property
    def architecture(self) -> str:
        """general.architecture ("llama", "qwen2", "gemma3", ...; "?" when absent)."""
        return str(self.fields.get("general.architecture", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata field by full key."""
        return self.fields.get(key, default)

    def arch_get(self, name: str, default: Any = None) -> Any:
        """``{architecture}.{name}``, e.g. ``arch_get("embedding_length")``."""
        return self.fields.get(f"{self.architecture}.{name}", default)

    @property
    def context_length(self) -> int | None:
        """The trained context length, if the file states it."""
        v = self.arch_get("context_length")
        return None if v is None else int(v)

    @property
    def vocab_size(self) -> int | None:
        """``{arch}.vocab_size``, else the length of the tokenizer's token list."""
        v = self.arch_get("vocab_size", self.array_lengths.get("tokenizer.ggml.tokens"))
        return None if v is None else int(v)

    @property
    def tokenizer(self) -> dict[str, Any]:
        """Tokenizer facts: model, chat template, special token ids, vocabulary size."""

        def opt_int(key: str) -> int | None:
            v = self.fields.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)

        return {"model": self.fields.get("tokenizer.ggml.model"), "chat_template": self.fields.get("tokenizer.chat_template"),
                "bos_token_id": opt_int("bos_token_id"), "eos_token_id": opt_int("eos_token_id"),
                "padding_token_id": opt_int("padding_token_id"), "add_bos_token": self.fields.get("tokenizer.ggml.add_bos_token"),
                "vocab_size": self.array_lengths.get("tokenizer.ggml.tokens")}

    def tensor(self, name: str) -> GGUFTensor:
        """A tensor table entry by name (KeyError names the file when absent)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.path}: no tensor {name!r}")

    def tensor_raw(self, mm: np.ndarray, t: GGUFTensor) -> np.ndarray:
        """The stored bytes of ``t`` from a memory map of the file, shaped as the gguf package does.

        Plain types come typed with ``t.shape``; quantized (and BF16) ones as uint8 rows of blocks.
        """
        import gguf

        buf = mm[t.offset: t.offset + t.n_bytes]
        if len(buf) != t.n_bytes:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r} is cut off (the file is truncated); "
                                 "re-download or re-convert it")
        dt = _PLAIN.get(t.type)
        if dt is not None:
            return buf.view(dt).reshape(t.shape)
        qt = gguf.GGMLQuantizationType[t.type]
        return buf.reshape(gguf.quant_shape_to_byte_shape(t.shape, qt))

    def dequantized(self) -> Iterator[tuple[GGUFTensor, np.ndarray]]:
        """Every tensor as float32 of its ``shape``, in file order (one memory map, no header re-parse)."""
        import gguf

        mm = np.memmap(self.path, mode="r")
        for t in self.tensors:
            a = gguf.dequantize(self.tensor_raw(mm, t), gguf.GGMLQuantizationType[t.type])
            a = np.asarray(a, dtype=np.float32).reshape(t.shape)
            yield t, a if a.flags.writeable else a.copy()  # F32 tensors are views of the read-only map

    def to_json(self) -> dict:
        """The cache file's content."""
        return {"version": CACHE_VERSION, "fields": self.fields, "array_lengths": self.array_lengths,
                "tensors": [asdict(t) for t in self.tensors]}

    @staticmethod
    def from_json(path: str, d: dict) -> GGUFMeta:
        """From :meth:`to_json`; a stale or malformed entry raises ValueError (the caller re-reads the file)."""
        if not isinstance(d, dict) or d.get("version") != CACHE_VERSION:
            raise ValueError("stale cache entry")
        tensors = tuple(GGUFTensor(t["name"], t["type"], tuple(t["shape"]), int(t["offset"]), int(t["n_bytes"]))
                        for t in d["tensors"])
        return GGUFMeta(path, dict(d["fields"]), {k: int(v) for k, v in d["array_lengths"].items()}, tensors)


def _unreadable(path: Path, why: object) -> ModelLoadError:
    return ModelLoadError(f"{path}: not a readable GGUF file (empty, truncated or corrupt: {why}); "
                          "re-download or re-convert it")


def parse_gguf(path: Path) -> GGUFMeta:
    """Parse the header with ``gguf.GGUFReader`` (slow: seconds; use :func:`read_gguf_meta`)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        if reader.byte_order != "I":
            raise ModelLoadError(f"{path}: a big-endian GGUF file; convert it for this machine's byte order")
        fields: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for key, f in reader.fields.items():
            if key.startswith("GGUF."):
                continue  # version / counts: the reader's own bookkeeping
            if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
                lengths[key] = len(f.data)
                if len(f.data) <= SHORT_ARRAY:
                    fields[key] = f.contents()
            else:
                fields[key] = f.contents()
        size = path.stat().st_size
        tensors = []
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise _unreadable(path, f"tensor {t.name!r} ends at byte {end} but the file has {size} bytes")
            tensors.append(GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                      int(t.data_offset), int(t.n_bytes)))
    except ModelLoadError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, EOFError) as e:
        raise _unreadable(path, e) from e
    return GGUFMeta(str(path), fields, lengths, tuple(tensors))


def read_gguf_meta(path: str | Path) -> GGUFMeta:
    """The header of a GGUF file: from the disk cache when this file was read before, else parsed and cached.

    A truncated or corrupt file raises :class:`ModelLoadError` naming it; a corrupt cache entry is re-read.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return _read_cached(path, file_key(path), str(cache_dir()))


@lru_cache(maxsize=8)
def _read_cached(path: Path, key: str, cache: str) -> GGUFMeta:
    """In-process memo on top of the disk cache (``key`` changes when the file does)."""
    f = Path(cache) / "gguf" / f"{key}.json"
    if f.is_file():
        try:
            return GGUFMeta.from_json(str(path), json.loads(f.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # stale or damaged entry: parse the file again and overwrite it
    meta = parse_gguf(path)
    atomic_write_text(f, json.dumps(meta.to_json()))
    return meta


def model_architecture(path: Path) -> str:
    """``model_type`` of an HF directory's config.json, or ``general.architecture`` of a GGUF file."""
    if path.is_dir():
        cfg = path / "config.json"
        try:
            return str(json.loads(cfg.read_text()).get("model_type", "?"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{cfg}: unreadable ({e}); expected a Hugging Face config.json") from e
    return read_gguf_meta(path).architecture
