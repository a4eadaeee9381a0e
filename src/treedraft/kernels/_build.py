"""Build-once, load-fast handling of the qgemm C++ extension (cached per machine and source)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

try:  # POSIX: the build lock (elsewhere concurrent first builds each build into their own folder)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

_SRC_DIR = Path(__file__).resolve().parent
_SOURCES = ["qgemm.cpp"]
_HEADERS = [
    "attn.h",
    "attn_avx2.h",
    "attn_avx512.h",
    "attn_gemm.h",
    "attn_kv.h",
    "attn_sched.h",
    "common.h",
    "f32mm.h",
    "fused.h",
    "fused_ops.h",
    "mm_core.h",
    "pool.h",
    "kern_scalar.h",
    "kern_avx512.h",
    "kern_avx2.h",
    "sample.h",
    "topk.h",
]
# -fvisibility=hidden: the headers' inline globals (the thread pool, g_threads) stay private to each
# build; by default they are GNU-unique symbols, shared by every build loaded in one process (two
# builds with different Pool layouts then run on one pool object and deadlock)
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fvisibility=hidden"]
LDFLAGS: list[str] = []
# TREEDRAFT_KERNEL_MARCH=<gcc -march value> builds for another target than this CPU (e.g. x86-64-v3 = AVX2 +
# FMA + F16C, what an AMD Zen 3 or a pre-Ice Lake client CPU runs): to package for older machines, or to
# measure and test the AVX2 code paths end to end on an AVX-512 machine. It is part of the build key, so each
# target gets its own build and, through calibrate's kernel key, its own latency curves.
ENV_MARCH = "TREEDRAFT_KERNEL_MARCH"


def cflags() -> list[str]:
    """CFLAGS with -march from TREEDRAFT_KERNEL_MARCH when set (ValueError on a value gcc could not take)."""
    march = os.environ.get(ENV_MARCH, "").strip()
    if not march:
        return list(CFLAGS)
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"{ENV_MARCH}={march!r}: give a gcc -march value such as native, x86-64-v3 or znver3")
    return [f"-march={march}" if f == "-march=native" else f for f in CFLAGS]


_lock = threading.Lock()
_state: dict[str, Any] = {
    "march": None,  # TREEDRAFT_KERNEL_MARCH of the loaded build (None: -march=native)
    "loaded": False,
    "module": None,
    "reason": None,
    "path": None,
    "built": False,
    "seconds": None,
}


def _cpu_signature() -> str:
    """CPU model name and feature flags (the build uses -march=native)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.processor(), platform.machine()):
                model = val.strip()
            elif key == "flags" and not flags:
                flags = " ".join(sorted(val.split()))
    except OSError:
        pass
    return f"{model}|{flags}"


def build_key() -> str:
    """Hash of everything the built module depends on."""
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((_SRC_DIR / name).read_bytes())
    for part in (
        _cpu_signature(),
        " ".join(cflags() + LDFLAGS),
        torch.__version__,
        sys.version.split()[0],
        platform.machine(),
    ):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """cache_dir()/kernels/<key>."""
    from treedraft.models.registry import cache_dir

    return cache_dir() / "kernels" / build_key()


def _module_name() -> str:
    return f"treedraft_qgemm_{build_key()}"


def _import_built(so: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(out: Path, name: str) -> ModuleType:
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    # cpp_extension runs `ninja` from PATH: add the pip `ninja` package's and this Python's bin dirs
    # (a venv that is not activated is not on PATH)
    extra = [str(Path(sys.executable).parent)]
    try:
        import ninja  # type: ignore[import-not-found]

        extra.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join(extra + [os.environ.get("PATH", "")])
    print(
        f"treedraft: building the quantized CPU kernel into {out} (one time, about a minute)...",
        file=sys.stderr,
        flush=True,
    )
    return cpp_extension.load(
        name=name,
        sources=[str(_SRC_DIR / s) for s in _SOURCES],
        extra_cflags=cflags(),
        extra_ldflags=LDFLAGS,
        extra_include_paths=[str(_SRC_DIR)],
        build_directory=str(out),
        verbose=False,
    )


COMPLETE = "complete"  # in a build folder: written (the .so's size) after the build imported; only then is it loaded
BUILD_WAIT_S = 600.0  # longest wait for another process's build before building beside it


def _complete(out: Path, name: str) -> bool:
    """Whether ``out`` holds a published build: its marker, naming the size of a .so that is there whole. A folder
    without it (a build killed half-way, or one from before session 44: torch's builder wrote the .so in place, and a
    truncated one killed every later process with SIGBUS) is built again."""
    so = out / f"{name}.so"
    try:
        return int((out / COMPLETE).read_text().strip()) == so.stat().st_size
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _build_lock(out: Path, timeout_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """One builder per build folder at a time, across processes (pytest -n): an flock on a file beside the folder, so
    a builder that dies lets go with its process (torch's own lock file, left by a killed build, made the next
    process wait for ever). After ``timeout_s`` the caller builds anyway (into its own temporary folder)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    f = open(out.with_name(out.name + ".lock"), "a+")
    try:
        if fcntl is not None:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        yield
    finally:
        f.close()  # (releases the flock)


def _build_and_publish(out: Path, name: str) -> ModuleType:
    """Build into this process's own temporary folder, import it, mark it complete, then rename it to ``out`` (a
    leftover incomplete ``out`` is replaced): no process ever imports a half-written .so."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.build")
    shutil.rmtree(tmp, ignore_errors=True)
    mod = _build(tmp, name)
    (tmp / COMPLETE).write_text(str((tmp / f"{name}.so").stat().st_size))
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        out.replace(old)  # (the folder of a killed build, or of a build from before the marker)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.replace(out)  # the module stays mapped from the renamed file
    except OSError:  # another process published first: its build is the same; ours is dropped
        shutil.rmtree(tmp, ignore_errors=True)
    return mod


def loaded_extension() -> ModuleType | None:
    """The extension if this process has already loaded it, else None (never builds or loads it)."""
    return _state["module"] if _state.get("loaded") else None


ENV_IDLE_YIELD = "TREEDRAFT_POOL_YIELD_US"
MAX_IDLE_US = 1_000_000  # an idle worker's spin or yield window: at most a second


def idle_yield_from_env() -> int | None:
    """``TREEDRAFT_POOL_YIELD_US`` as microseconds (None: unset, the built-in default); a ValueError naming the
    variable when it is not a whole number from 0 to MAX_IDLE_US."""
    raw = os.environ.get(ENV_IDLE_YIELD, "").strip()
    if not raw:
        return None
    try:
        us = int(raw)
    except ValueError:
        us = -1
    if not 0 <= us <= MAX_IDLE_US:
        raise ValueError(
            f"{ENV_IDLE_YIELD} must be a whole number of microseconds from 0 (sleep after the short spin) to "
            f"{MAX_IDLE_US}, got {raw!r}"
        )
    return us


def load_extension(reload: bool = False) -> ModuleType | None:
    """The extension module (built at first use), or None with the reason in build_info()."""
    if _state["loaded"] and not reload:  # fast path of every mm call
        return _state["module"]
    with _lock:
        if _state["loaded"] and not reload:
            return _state["module"]
        _state.update(loaded=True, module=None, reason=None, built=False, seconds=None, march=None)
        if os.environ.get("TREEDRAFT_NO_EXT", "").strip().lower() not in ("", "0", "false", "no", "off"):
            _state["reason"] = "disabled by TREEDRAFT_NO_EXT"
            return None
        t0 = time.perf_counter()
        try:
            out, name = build_dir(), _module_name()
            so = out / f"{name}.so"
            _state["path"] = str(so)
            if name in sys.modules:
                mod = sys.modules[name]
            elif _complete(out, name):
                mod = _import_built(so, name)
            else:
                with _build_lock(out):
                    if _complete(out, name):  # another process built it while this one waited
                        mod = _import_built(so, name)
                    else:
                        mod = _build_and_publish(out, name)
                        _state["built"] = True
            mod.set_num_threads(max(1, torch.get_num_threads()))
        except Exception as e:
            _state["reason"] = f"build or load failed: {type(e).__name__}: {str(e).strip()[-800:]}"
            # said once (a bad TREEDRAFT_KERNEL_MARCH, a missing compiler): the PyTorch fallback is several times slower
            print(
                f"treedraft: the native CPU kernels are unavailable ({_state['reason'][:300]}); decoding falls back to "
                "PyTorch's kernels, several times slower (TREEDRAFT_NO_EXT=1 chooses that without trying)",
                file=sys.stderr,
                flush=True,
            )
            return None
        try:
            idle = idle_yield_from_env()
        except ValueError as e:  # a bad setting must not cost the kernels: said, and the default kept
            print(f"treedraft: {e}; using the default", file=sys.stderr)
            idle = None
        if idle is not None:
            mod.set_yield_us(idle)
        _state["module"] = mod
        _state["march"] = os.environ.get(ENV_MARCH, "").strip() or None
        _state["seconds"] = time.perf_counter() - t0
        return mod


def build_info() -> dict[str, Any]:
    """Where the module lives, whether this process built it, how long loading took, why not, and the -march it was
    built for when TREEDRAFT_KERNEL_MARCH chose one (None: this CPU's own)."""
    load_extension()
    keys = ("path", "built", "seconds", "reason", "march")
    return {k: _state[k] for k in keys} | {"available": _state["module"] is not None}
