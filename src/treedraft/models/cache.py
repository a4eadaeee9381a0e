"""The user cache: where converted weights, GGUF headers, tokenizers and measurements live."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path


def cache_dir() -> Path:
    """Where converted weights/tokenizers are cached (TREEDRAFT_CACHE, default ~/.cache/treedraft; an empty value, as
    ``TREEDRAFT_CACHE=$UNSET`` gives, is the default too: it put every cache in the working directory), absolute."""
    given = os.environ.get("TREEDRAFT_CACHE", "").strip()
    return (Path(given).expanduser() if given else Path.home() / ".cache" / "treedraft").resolve()


def read_json_cache(f: Path, what: str = "cache entry") -> object | None:
    """The JSON in cache file ``f``, or None when there is none or it cannot be read (a torn write, another tool's
    file): said on stderr, and the caller measures or builds it again instead of failing the load."""
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        print(f"treedraft: the {what} {f} cannot be read ({e}); making it again", file=sys.stderr, flush=True)
        return None


def file_key(p: Path) -> str:
    """16 hex digits naming a file's identity: its resolved path, size and modification time."""
    st = p.stat()
    return hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def temp_sibling(path: Path) -> Path:
    """Where this process writes ``path``'s content before a rename publishes it (per process: concurrent
    writers of the same cache entry, e.g. pytest-xdist workers, never share a temporary)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    tmp.write_text(text)
    tmp.replace(path)


def save_tensors(tensors: dict, path: str | Path) -> None:
    """``safetensors.torch.save_file`` with the file's mode as any other new file's (0666 less the umask): the library
    creates it 0600, so trained heads on a shared machine could not be read by the others who use them."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = temp_sibling(path)  # whole, then renamed: an interrupted write never leaves a torn file
    save_file(tensors, str(tmp))
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_dir(tmp: Path, out: Path, marker: str) -> bool:
    """Move the directory ``tmp`` (this process's, see :func:`temp_sibling`) to ``out`` by one rename, so a
    concurrent reader finds all of it or nothing. A leftover ``out`` without the file ``marker`` is removed
    first; when another process published ``out`` first (a non-empty directory is not replaced), ``tmp`` is
    dropped. Returns whether ``out`` now holds ``marker``."""
    if out.exists() and not (out / marker).is_file():
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.replace(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return (out / marker).is_file()
