"""Per-machine measurements (kernel plans, tree calibration), cached under ``cache_dir()/tune/``.

A measurement is keyed by :func:`machine_key` (what makes timings differ between machines) plus
the caller's own key parts (model file, dtype, ...). :func:`cached_measurement` returns the cached
value or measures and stores it; a missing, unreadable or unusable entry, or ``TREEDRAFT_RETUNE=1``,
measures again. Kernel plans (:func:`pack_tuned`), quantized-linear kernel choices and Medusa trees
all go through it.

Busy machines: an entry records the 1-minute load average it was measured under. One measured while the
machine was oversubscribed (load above the core count: other processes took part of the timings) is
used as is while the machine stays busy, and measured again the first time it is used on a quiet
machine (load below half the cores), so a timing taken under someone else's load does not stick.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import torch

from .cache import atomic_write_text, cache_dir, file_key

T = TypeVar("T")
# CPU features that change which kernels win: SIMD width, dot-product and bf16/int8 matrix units
_ISA = {
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",  # x86 (/proc/cpuinfo "flags")
    "asimd",
    "asimddp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
    "fphp",
    "asimdhp",
}  # arm64 ("Features")


@lru_cache(maxsize=1)
def _cpu() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, relevant ISA flags) from /proc/cpuinfo, else from ``platform``."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                k = k.strip()
                if k in ("model name", "Hardware", "CPU part") and not name:
                    name = v.strip()
                elif k in ("flags", "Features") and not flags:
                    flags = set(v.split()) & _ISA
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), tuple(sorted(flags))


def machine_key(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What makes a timing specific to this machine: CPU model, ISA flags, torch, threads (+ the GPU)."""
    cpu, isa = _cpu()
    key: dict[str, Any] = {
        "cpu": cpu,
        "isa": list(isa),
        "arch": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    dev = torch.device(device)
    if dev.type == "cuda":
        i = dev.index if dev.index is not None else torch.cuda.current_device()
        key["gpu"] = torch.cuda.get_device_name(i)
        key["cuda"] = torch.version.cuda
    return key


def retune_requested() -> bool:
    """TREEDRAFT_RETUNE=1 (any value but empty or 0): ignore cached measurements and measure again."""
    return os.environ.get("TREEDRAFT_RETUNE", "") not in ("", "0")


def measurement_path(kind: str, key_parts: Mapping[str, Any], device: str | torch.device = "cpu") -> tuple[Path, dict]:
    """(cache file, full key) of a measurement of ``kind`` for ``key_parts`` on this machine."""
    key = {"kind": kind, "machine": machine_key(device), **dict(key_parts)}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "tune" / f"{kind}-{digest}.json", key


def load_average() -> float:
    """The 1-minute load average (0.0 where the OS does not report one)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return 0.0


def measured_busy(entry: Mapping[str, Any], now: float | None = None) -> bool:
    """Whether a cached entry was measured on an oversubscribed machine that is quiet now (measure again)."""
    cores = os.cpu_count() or 1
    now = load_average() if now is None else now
    return float(entry.get("load", 0.0)) > cores and now < cores / 2


def store_measurement(kind: str, key_parts: Mapping[str, Any], value: Any, device: str | torch.device = "cpu") -> Path:
    """Write ``value`` (JSON-serialisable) as the cached measurement, with the load it was taken under."""
    f, key = measurement_path(kind, key_parts, device)
    atomic_write_text(f, json.dumps({"key": key, "value": value, "load": load_average()}, indent=1, default=str))
    return f


def cached_measurement(
    kind: str,
    key_parts: Mapping[str, Any],
    measure: Callable[[], Any],
    load: Callable[[Any], T] = lambda v: v,
    device: str | torch.device = "cpu",
) -> T:
    """``load(value)`` of the cached measurement, measuring (``measure()``, JSON-serialisable) when needed.

    ``load`` turns the stored JSON back into what the caller uses and raises ValueError, KeyError or
    TypeError for an unusable value: the entry is then measured again, like a missing or corrupt file.
    """
    f, key = measurement_path(kind, key_parts, device)
    if f.is_file() and not retune_requested():
        try:
            d = json.loads(f.read_text())
            if json.loads(json.dumps(key, default=str)) != d["key"]:
                raise ValueError("key mismatch")
            if measured_busy(d):
                raise ValueError("measured under load; the machine is quiet now")
            return load(d["value"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # unreadable or unusable entry: measure again and overwrite it
    value = measure()
    store_measurement(kind, key_parts, value, device)
    return load(value)


def _checked_plan(v: Any) -> dict[int, str]:
    """A stored kernel plan {rows: "strategy[@pad]"}; ValueError when it is not one."""
    from .llama import MATMUL_STRATEGIES

    if not isinstance(v, dict) or not v:
        raise ValueError("not a plan")
    plan = {}
    for rows, cand in v.items():
        strategy, _, pad = str(cand).partition("@")
        if strategy not in MATMUL_STRATEGIES or (pad and int(pad) < int(rows)):
            raise ValueError(f"bad plan entry {rows}: {cand}")
        plan[int(rows)] = str(cand)
    return plan


def pack_tuned(net: Any, path: Path, dtype: torch.dtype) -> None:
    """``net.pack()`` with its measured kernel plan cached per machine, model file and dtype.

    Tuning takes a few seconds once; TREEDRAFT_RETUNE=1 forces a new measurement.
    """
    # v2: one entry per row count up to 16 and padded kernels (a v1 plan lacks rows 5, 7, 9, ...)
    parts = {"plan": "v2", "model": file_key(path), "dtype": str(dtype)}

    def use(v: Any) -> None:
        plan = _checked_plan(v)
        if getattr(net, "matmul_plan", None) != plan:  # not the plan measure() has just packed
            net.pack(plan)

    cached_measurement("matmul-plan", parts, lambda: {str(k): v for k, v in net.pack().matmul_plan.items()}, use)
