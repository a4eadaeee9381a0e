"""Per-machine measurements (kernel plans, tree calibration), cached under ``cache_dir()/tune/``.

A measurement is keyed by :func:`machine_key` (what makes timings differ between machines) plus
the caller's own key parts (model file, dtype, ...). :func:`cached_measurement` returns the cached
value or measures and stores it; a missing, unreadable or unusable entry, or ``TREEDRAFT_RETUNE=1``,
measures again. Kernel plans (:func:`pack_tuned`), quantized-linear kernel choices and Medusa trees
all go through it.

Busy machines: an entry records how much CPU *other* processes used while it was measured (:class:`CpuWindow`:
all CPUs' busy and stolen time from /proc/stat minus this process's own, in cores; the 1-minute load average
where /proc/stat is missing). One measured while others took at least half a core is used as is while the
machine stays busy, and measured again the first time it is used while others take under a quarter of a core
(sampled for a quarter of a second), so a timing taken under someone else's load does not stick. Counting
others' CPU rather than the load average matters: the load average includes this process itself, so a long
benchmark (which keeps both cores busy on its own) never looked quiet and kept a timing taken under another
job's load for its whole run (session 13: EAGLE's drafting cost, measured during a test run, cost it a tenth
of its speed in the next 80-prompt bench).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
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


BUSY_OTHERS = 0.5  # cores' worth of other processes' CPU during a measurement that marks it busy
QUIET_OTHERS = 0.25  # ... and below which the machine counts as quiet again (re-measure a busy entry)
QUIET_SAMPLE_S = 0.25  # how long a busy entry's check watches the machine


def _cpu_ticks() -> float | None:
    """Seconds all CPUs spent busy (user, nice, system, irq, softirq, steal) since boot; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """Other processes' CPU use (in cores) between construction and :meth:`others`.

    All CPUs' busy time (stolen time included: a hypervisor's other guests count as others) minus this
    process's own user + system time, over the wall time. None where /proc/stat is unavailable."""

    def __init__(self) -> None:
        self._t, self._busy, self._own = time.monotonic(), _cpu_ticks(), self._own_seconds()

    @staticmethod
    def _own_seconds() -> float:
        t = os.times()
        return t.user + t.system

    def others(self) -> float | None:
        """Cores' worth of CPU that other processes used since construction (>= 0), or None."""
        busy = _cpu_ticks()
        wall = time.monotonic() - self._t
        if busy is None or self._busy is None or wall <= 0:
            return None
        return max(0.0, (busy - self._busy - (self._own_seconds() - self._own)) / wall)


_SAMPLE_REUSE_S = 10.0  # a load reads several cached entries: one sample serves them all
_last_sample: tuple[float, float | None] | None = None  # (monotonic time, others) of the latest sample


def others_now(seconds: float = QUIET_SAMPLE_S) -> float | None:
    """Other processes' CPU use over the next ``seconds`` (this thread sleeps meanwhile), or None; a sample
    taken in the last few seconds is reused."""
    global _last_sample
    if _last_sample is not None and time.monotonic() - _last_sample[0] < _SAMPLE_REUSE_S:
        return _last_sample[1]
    w = CpuWindow()
    time.sleep(seconds)
    _last_sample = (time.monotonic(), w.others())
    return _last_sample[1]


def measured_busy(entry: Mapping[str, Any], now: float | None = None) -> bool:
    """Whether a cached entry was measured on a busy machine that is quiet now (measure it again).

    With ``others`` recorded (cores of other processes' CPU during the measurement): busy at >= BUSY_OTHERS,
    quiet when others now (``now``, else sampled) < QUIET_OTHERS. Older entries, or no /proc/stat: the load
    average, busy above the core count and quiet below half of it."""
    others = entry.get("others")
    if others is not None:
        if float(others) < BUSY_OTHERS:
            return False
        now = others_now() if now is None else now
        return now is not None and now < QUIET_OTHERS
    cores = os.cpu_count() or 1
    now = load_average() if now is None else now
    return float(entry.get("load", 0.0)) > cores and now < cores / 2


def store_measurement(
    kind: str,
    key_parts: Mapping[str, Any],
    value: Any,
    device: str | torch.device = "cpu",
    others: float | None = None,
) -> Path:
    """Write ``value`` (JSON-serialisable) as the cached measurement, with the load it was taken under
    (and other processes' CPU use during it, in cores, when the caller watched it with a CpuWindow)."""
    f, key = measurement_path(kind, key_parts, device)
    entry = {"key": key, "value": value, "load": load_average()}
    if others is not None:
        entry["others"] = round(others, 3)
    atomic_write_text(f, json.dumps(entry, indent=1, default=str))
    return f


def cached_measurement(
    kind: str,
    key_parts: Mapping[str, Any],
    measure: Callable[[], Any],
    load: Callable[[Any], T] = lambda v: v,
    device: str | torch.device = "cpu",
    stale: Callable[[Any], bool] | None = None,
) -> T:
    """``load(value)`` of the cached measurement, measuring (``measure()``, JSON-serialisable) when needed.

    ``load`` turns the stored JSON back into what the caller uses and raises ValueError, KeyError or
    TypeError for an unusable value: the entry is then measured again, like a missing or corrupt file.
    ``stale(stored value)``, asked of a cached entry that ``load`` accepted (never of a value just measured): True
    measures it again too (e.g. budget.measured_latency's check of a curve against this machine now).
    """
    f, key = measurement_path(kind, key_parts, device)
    if f.is_file() and not retune_requested():
        try:
            d = json.loads(f.read_text())
            if json.loads(json.dumps(key, default=str)) != d["key"]:
                raise ValueError("key mismatch")
            if measured_busy(d):
                raise ValueError("measured while other processes were busy; the machine is quiet now")
            value = load(d["value"])
            if stale is not None and stale(d["value"]):
                raise ValueError("stale: measured under other conditions than this machine's now")
            return value
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # unreadable or unusable entry: measure again and overwrite it
    window = CpuWindow()
    value = measure()
    store_measurement(kind, key_parts, value, device, others=window.others())
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
    """The fp32 CPU decode path: row-invariant when it can be, else ``net.pack()`` with its measured plan.

    With the native extension and float32 weights every linear of a decode step or tree (up to 64 rows) runs
    ``kernels.mm_f32`` and attention the row-invariant ``kernels.attend`` (``exact_attention``), so greedy
    speculative decoding reproduces plain decoding bit for bit, as on the int4/int8 paths. Otherwise (no
    extension, bf16/fp16) the fastest BLAS kernel per row count, measured once per machine (a few seconds;
    TREEDRAFT_RETUNE=1 measures again): faster for some row counts, but a tree row may then differ from the
    1-token row in the last bits, and a greedy near-tie can go the other way.
    """
    from .matmul import exact_plan, exact_plan_available

    if exact_plan_available(dtype) and hasattr(net, "exact_attention"):
        net.pack(exact_plan())
        net.exact_attention = True
        return
    # v2: one entry per row count up to 16 and padded kernels (a v1 plan lacks rows 5, 7, 9, ...)
    parts = {"plan": "v2", "model": file_key(path), "dtype": str(dtype)}

    def use(v: Any) -> None:
        plan = _checked_plan(v)
        if getattr(net, "matmul_plan", None) != plan:  # not the plan measure() has just packed
            net.pack(plan)

    cached_measurement("matmul-plan", parts, lambda: {str(k): v for k, v in net.pack().matmul_plan.items()}, use)
