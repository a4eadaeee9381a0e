"""The user cache: where converted weights, GGUF headers, tokenizers and measurements live."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted weights/tokenizers are cached (TREEDRAFT_CACHE, default ~/.cache/treedraft)."""
    return Path(os.environ.get("TREEDRAFT_CACHE", Path.home() / ".cache" / "treedraft"))


def file_key(p: Path) -> str:
    """16 hex digits naming a file's identity: its resolved path, size and modification time."""
    st = p.stat()
    return hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
