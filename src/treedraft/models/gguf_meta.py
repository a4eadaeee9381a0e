"""The one GGUF metadata reader: a header parse that skips long arrays, cached on disk.

The header is walked once per file (identity: :func:`~treedraft.models.cache.file_key`) by
:func:`parse_gguf`: scalars, strings and arrays of up to ``SHORT_ARRAY`` items are kept, longer
arrays (the tokenizer's 49k-262k tokens, scores, merges) only by length, and the tensor table
(name, ggml type, shape, absolute offset, byte size) is stored as JSON under ``cache_dir()/gguf/``.
Tensor data is read straight from a memory map through that table. ``gguf.GGUFReader`` builds a
numpy view for every array item (6-16 s for SmolLM2, 27-77 s for Gemma 3's 262k vocabulary on a busy
CPU), so it is not used here; the tokenizer's arrays are read by transformers' GGUF converter in
:meth:`treedraft.tokenizer.Tokenizer.from_gguf` (once per file, then cached as tokenizer.json).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import json
import mmap
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
_PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}  # types the gguf package hands out as typed arrays; the rest as uint8 block rows


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

        return {
            "model": self.fields.get("tokenizer.ggml.model"),
            "chat_template": self.fields.get("tokenizer.chat_template"),
            "bos_token_id": opt_int("bos_token_id"),
            "eos_token_id": opt_int("eos_token_id"),
            "padding_token_id": opt_int("padding_token_id"),
            "add_bos_token": self.fields.get("tokenizer.ggml.add_bos_token"),
            "vocab_size": self.array_lengths.get("tokenizer.ggml.tokens"),
        }

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

        buf = mm[t.offset : t.offset + t.n_bytes]
        if len(buf) != t.n_bytes:
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} is cut off (the file is truncated); re-download or re-convert it"
            )
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
            try:
                a = gguf.dequantize(self.tensor_raw(mm, t), gguf.GGMLQuantizationType[t.type])
            except NotImplementedError:  # a type the gguf package knows but cannot dequantize
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} is of type {t.type}, which the installed gguf package cannot "
                    "dequantize; give a GGUF of other types (e.g. Q4_K_M, Q8_0), or try --runtime hf"
                ) from None
            a = np.asarray(a, dtype=np.float32).reshape(t.shape)
            yield t, a if a.flags.writeable else a.copy()  # F32 tensors are views of the read-only map

    def to_json(self) -> dict:
        """The cache file's content."""
        return {
            "version": CACHE_VERSION,
            "fields": self.fields,
            "array_lengths": self.array_lengths,
            "tensors": [asdict(t) for t in self.tensors],
        }

    @staticmethod
    def from_json(path: str, d: dict) -> GGUFMeta:
        """From :meth:`to_json`; a stale or malformed entry raises ValueError (the caller re-reads the file)."""
        if not isinstance(d, dict) or d.get("version") != CACHE_VERSION:
            raise ValueError("stale cache entry")
        tensors = tuple(
            GGUFTensor(t["name"], t["type"], tuple(t["shape"]), int(t["offset"]), int(t["n_bytes"]))
            for t in d["tensors"]
        )
        return GGUFMeta(path, dict(d["fields"]), {k: int(v) for k, v in d["array_lengths"].items()}, tensors)


def _unreadable(path: Path, why: object) -> ModelLoadError:
    return ModelLoadError(
        f"{path}: not a readable GGUF file (empty, truncated or corrupt: {why}); re-download or re-convert it"
    )


# GGUF metadata value types -> struct format of a scalar (8 = string, 9 = array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """A cursor over the file's bytes (a memory map): every read checks that the bytes exist."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]  # struct.error past the end
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError(f"a {n}-byte string at byte {self.pos} runs past the end of the file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8")  # UnicodeDecodeError is a ValueError
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")

    def skip(self, vtype: int, n: int) -> None:
        """Step over ``n`` values of ``vtype`` without building them (strings: one length read each)."""
        if vtype in _SCALAR:
            self.pos += n * struct.calcsize(_SCALAR[vtype])
        elif vtype == _STRING:
            buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
            for _ in range(n):  # a u64 length, then that many bytes
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        elif vtype == _ARRAY:
            for _ in range(n):
                etype, m = self.scalar("<I"), self.scalar("<Q")
                self.skip(etype, m)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")
        if self.pos > len(self.buf):
            raise EOFError(f"an array runs past the end of the file (byte {self.pos})")


def parse_gguf(path: Path) -> GGUFMeta:
    """Parse the header (long arrays skipped; use :func:`read_gguf_meta`, which caches the result)."""
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            h = _Header(buf)
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic at the start")
            h.pos = 4
            version = h.scalar("<I")
            if version & 0xFFFF == 0:
                raise ModelLoadError(f"{path}: a big-endian GGUF file; convert it for this machine's byte order")
            if version not in (2, 3):
                raise ModelLoadError(
                    f"{path}: GGUF version {version} is not supported (2 and 3 are); "
                    "re-convert it with a current llama.cpp"
                )
            n_tensors, n_kv = h.scalar("<Q"), h.scalar("<Q")
            fields: dict[str, Any] = {}
            lengths: dict[str, int] = {}
            for _ in range(n_kv):
                key, vtype = h.string(), h.scalar("<I")
                if vtype != _ARRAY:
                    fields[key] = h.value(vtype)
                    continue
                etype, n = h.scalar("<I"), h.scalar("<Q")
                lengths[key] = n
                if n <= SHORT_ARRAY and etype != _ARRAY:
                    fields[key] = [h.value(etype) for _ in range(n)]
                else:
                    h.skip(etype, n)
            infos = []
            for _ in range(n_tensors):
                name = h.string()
                dims = [h.scalar("<Q") for _ in range(h.scalar("<I"))]  # GGUF order: fastest-varying first
                infos.append((name, dims, h.scalar("<I"), h.scalar("<Q")))
            align = int(fields.get("general.alignment", 32))
            if align < 1:
                raise ValueError(f"general.alignment is {align}; a GGUF's alignment is a positive number of bytes")
            start = -(-h.pos // align) * align  # tensor data begins at the next multiple of the alignment
            size = len(buf)
        tensors = []
        for name, dims, qtype, off in infos:
            if qtype not in GGML_QUANT_SIZES:  # (a newer llama.cpp's type: the file may be fine)
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has ggml type {qtype}, unknown to the installed gguf package "
                    f"({getattr(gguf, '__version__', '?')}); upgrade gguf, or give a GGUF of other types"
                )
            per, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // per
            end = start + off + n_bytes
            if end > size:
                raise _unreadable(path, f"tensor {name!r} ends at byte {end} but the file has {size} bytes")
            tensors.append(
                GGUFTensor(
                    name, GGMLQuantizationType(qtype).name, tuple(int(d) for d in reversed(dims)), start + off, n_bytes
                )
            )
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
