"""``--weights {auto,fp32,int8,int4}``: the GGUF's own quantized blocks -> quantized linears of the model.

:func:`gguf_weights` maps each GGUF linear tensor onto the model's fused modules (q|k|v -> ``wqkv``,
gate|up -> ``w13``), keeping the file's quantized values where an exact mapping exists
(:mod:`.gguf_blocks`); :func:`apply_weights` chooses the kernels by measurement, swaps the modules and
caches the per-machine choice next to the fp32 kernel plan.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from . import gguf_blocks as gb
from .errors import ModelLoadError
from .gguf_meta import read_gguf_meta
from .quant import (
    WEIGHTS,
    NativeLinear,
    QWeight,
    choose_kernels,
    choose_q4_pair,
    native_kernels,
    quantize_q4_rtn,
    quantize_q8_rtn,
    swap_linears,
    time_modules,
)

_PARTS = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w13": ("ffn_gate", "ffn_up"),
    "w2": ("ffn_down",),
}
_OWNER = {"wqkv": "attn", "wo": "attn", "w13": "ffn", "w2": "ffn"}
TYPE_NAMES = {
    gb.F32: "F32",
    gb.F16: "F16",
    gb.Q4_0: "Q4_0",
    gb.Q4_1: "Q4_1",
    gb.Q5_0: "Q5_0",
    gb.Q8_0: "Q8_0",
    gb.Q4_K: "Q4_K",
    gb.Q6_K: "Q6_K",
}


def check_weights(weights: str) -> str:
    """``weights`` if it is one of :data:`WEIGHTS`, else a ValueError listing them."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    return weights


def _type_name(t: int) -> str:
    return TYPE_NAMES.get(t, f"ggml type {t}")


def _tensor_qweight(
    name: str, qtype: int, data: np.ndarray, shape: tuple[int, int], want: str, inexact: dict[str, list[str]]
) -> QWeight:
    """One GGUF tensor as a QWeight in the format ``want`` asks ('q4' or 'q8')."""
    if want == "q4" and qtype in gb.UNPACK_Q4:
        return QWeight("q4", gb.UNPACK_Q4[qtype](data, shape), f"gguf {_type_name(qtype)}")
    if qtype == gb.Q8_0:
        return QWeight("q8", gb.unpack_q8_0(data, shape), "gguf Q8_0")
    if qtype == gb.Q5_0:  # 5-bit values fit int8 with the same scale: kept exactly, for int4 and int8 alike
        return QWeight("q8", gb.unpack_q5_0(data, shape), "gguf Q5_0")
    if qtype in gb.UNPACK_Q4:  # int8 from 4-bit blocks: the same float weights as gguf's numpy dequantize, ~10x faster
        return quantize_q8_rtn(gb.dequantize_q4(*gb.UNPACK_Q4[qtype](data, shape)))
    import gguf

    w = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(shape))
    if qtype in (gb.F32, gb.F16):  # float tensors: round-to-nearest in the asked format
        return (quantize_q4_rtn if want == "q4" else quantize_q8_rtn)(w)
    if want == "q4":  # a quantized type with no exact 4-bit mapping (Q6_K, Q5_*, ...): int8 with a warning
        inexact.setdefault(_type_name(qtype), []).append(name)
    return quantize_q8_rtn(w)


def _fp16_scales(qw: QWeight) -> QWeight:
    """A 4-bit weight with its group scales and mins rounded to fp16, the packed kernels' storage: a no-op for
    Q4_0 / Q4_1 (fp16 in the file), a rounding of Q4_K's d*sc and dmin*mn (see gguf_blocks). Done after the
    concatenation, so a fused matmul that goes to int8 (mixed formats) re-quantizes the exact values."""
    if qw.fmt != "q4":
        return qw
    scale, minv, q = qw.parts
    return QWeight("q4", (scale.half().float(), minv.half().float(), q), qw.source)


def _concat(parts: list[QWeight]) -> QWeight:
    """Row-wise concatenation of same-format weights (a fused q|k|v or gate|up)."""
    if len(parts) == 1:
        return parts[0]
    if len({p.fmt for p in parts}) > 1:  # mixed formats in one fused matmul: all int8
        parts = [p if p.fmt == "q8" else quantize_q8_rtn(p.dequantize()) for p in parts]
    cat = tuple(torch.cat([p.parts[i] for p in parts]) for i in range(len(parts[0].parts)))
    return QWeight(parts[0].fmt, cat, "+".join(sorted({p.source for p in parts})))


def gguf_weights(
    path: str | Path, num_layers: int, num_heads: int, num_kv_heads: int, weights: str, tied: bool
) -> dict[str, QWeight]:
    """Module name -> QWeight for every linear of a Llama-family GGUF (``weights``: 'int4' or 'int8').

    int4 keeps Q4_0/Q4_1/Q4_K blocks exactly; Q8_0 stays Q8_0; any other quantized type is dequantized
    and re-quantized to int8 with one warning per type that names its tensors.
    """
    import gguf

    meta = read_gguf_meta(path)  # cached header: tensor table with offsets, no second parse
    mm = np.memmap(meta.path, dtype=np.uint8, mode="r")
    tensors = {t.name: t for t in meta.tensors}
    arch = meta.architecture
    want = "q4" if weights == "int4" else "q8"
    inexact: dict[str, list[str]] = {}

    def one(name: str, n_head: int | None = None) -> QWeight:
        t = tensors.get(name)
        if t is None or len(t.shape) != 2:
            raise ModelLoadError(
                f"{path}: no 2-D tensor {name!r} (found {t.shape if t else 'none'}); "
                "re-convert the model from its Hugging Face checkpoint"
            )
        shape = (t.shape[0], t.shape[1])
        qtype = int(gguf.GGMLQuantizationType[t.type])
        data = meta.tensor_raw(mm, t)  # quantized: (rows, bytes per row) uint8; F32/F16: typed (rows, cols)
        qw = _tensor_qweight(name, qtype, data, shape, want, inexact)
        if n_head and arch == "llama":  # undo llama.cpp's q/k row permutation (see loaders._unpermute_rope)
            rows = shape[0]
            perm = torch.arange(rows).view(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(rows)  # new <- old
            qw = QWeight(qw.fmt, tuple(p[perm] for p in qw.parts), qw.source)
        return qw

    out: dict[str, QWeight] = {}
    for i in range(num_layers):
        for mod, names in _PARTS.items():
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
            parts = [one(f"blk.{i}.{n}.weight", heads.get(n)) for n in names]
            out[f"layers.{i}.{_OWNER[mod]}.{mod}"] = _fp16_scales(_concat(parts))
    out["lm_head"] = _fp16_scales(one("token_embd.weight" if tied else "output.weight"))
    for tname, names in inexact.items():
        warnings.warn(
            f"{path}: no exact 4-bit mapping for GGUF type {tname}: tensors {', '.join(names)} are "
            "dequantized and re-quantized to int8 (group 32)",
            stacklevel=2,
        )
    return out


def float_weights(model: torch.nn.Module, weights: str) -> dict[str, QWeight]:
    """Round-to-nearest quantization of the model's own float linears (HF directories, tiny models)."""
    from .llama import Linear

    rtn = quantize_q4_rtn if weights == "int4" else quantize_q8_rtn
    return {n: rtn(m.weight.detach()) for n, m in model.named_modules() if isinstance(m, Linear)}


def _machine_key(path: Path | None, extra: str) -> str:
    from .plan import machine_key
    from .registry import file_key

    m = machine_key()  # CPU model, ISA flags (a KVM guest's model name is generic: "Intel(R) Xeon(R) Processor"), ...
    fk = file_key(path) if path is not None and path.is_file() else str(path)
    return hashlib.sha1(
        # v2 (session 41): the Q8_0 kernel's VNNI path got 1.3x faster and int4 / int8 are timed in alternating rounds:
        # choices made before are made again. v3 (session 44): the ISA flags and the kernel build are in the key (an
        # AVX2 build, TREEDRAFT_KERNEL_MARCH=x86-64-v3, reused the AVX-512 build's choices unmeasured)
        f"quant-v3|{m['cpu']}|{','.join(m['isa'])}|{m['torch']}|{m['threads']}|{fk}|{extra}".encode()
    ).hexdigest()[:16]


def _read_tune(f: Path, *keys: str) -> dict | None:
    """A tune file's dict when it holds ``keys`` (None: missing, unreadable, incomplete, or TREEDRAFT_RETUNE: measured
    again; a torn file failed the load with a JSONDecodeError)."""
    from .cache import read_json_cache
    from .plan import retune_requested

    if retune_requested():  # (TREEDRAFT_RETUNE=0 measured again too: any value but empty or 0 asks)
        return None
    got = read_json_cache(f, "measurement")
    return got if isinstance(got, dict) and all(k in got for k in keys) else None


def _top1_agreement(model: torch.nn.Module, ids: Tensor, ref: Tensor) -> float:
    with torch.inference_mode():
        logits = model.forward(ids[None], torch.arange(len(ids)))[0][0]
    return float((logits.argmax(-1) == ref).float().mean())


def apply_weights(
    model: torch.nn.Module,
    path: Path | None,
    weights: str,
    probe_ids: list[int] | None = None,
    min_agreement: float = 0.9,
    log=None,
) -> dict:
    """Swap the model's linears for ``weights`` ('fp32' leaves them); return what was chosen and measured.

    'auto' measures fp32 (the model's packed plan) against int4 and int8 on this machine (all linears,
    1 and 16 rows) and keeps the fastest whose next-token top-1 agreement with fp32 on ``probe_ids`` is at
    least ``min_agreement``; the choice and the per-format kernels are cached per machine, torch version,
    thread count and model file (TREEDRAFT_RETUNE=1 measures again).
    """
    from .cache import atomic_write_text
    from .registry import cache_dir

    check_weights(weights)
    info: dict = {"weights": weights}
    if weights == "fp32":
        return info
    natives = native_kernels()

    build = _kernel_build_key() if natives is not None else None

    def tune_file(w: str) -> Path:
        return cache_dir() / "tune" / f"quant-{_machine_key(path, f'{w}|native={build}')}.json"

    f = tune_file(weights)
    cached = _read_tune(f, *(("chosen", "kernels_by_format") if weights == "auto" else ("kernels",)))
    is_gguf = path is not None and path.is_file() and path.suffix == ".gguf"
    cfg = getattr(model, "config", None)

    def qweights(w: str) -> dict[str, QWeight]:
        if is_gguf:
            return gguf_weights(path, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, w, cfg.tie_embeddings)
        return float_weights(model, w)

    if weights == "auto":
        measured: dict[str, dict[str, QWeight]] = {}
        if cached is None:
            cached = _measure_auto(model, qweights, natives, probe_ids, min_agreement, log, measured)
            atomic_write_text(f, json.dumps(cached))  # concurrent loads (pytest -n) never read half a file
            for w, kernels in cached["kernels_by_format"].items():  # what --weights int4/int8 would measure
                if not tune_file(w).is_file():
                    pair = {k: v for k, v in cached.items() if k.startswith("q4_pair@")} if w == "int4" else {}
                    atomic_write_text(tune_file(w), json.dumps({"kernels": kernels, **pair}))
        info.update((k, v) for k, v in cached.items() if not k.startswith("q4_pair@"))
        weights = cached["chosen"]
        if weights == "fp32":
            _pack_fp32(model, path)
            return info
        qw = measured.get(weights) or qweights(weights)  # the measured weights, else read once
    else:
        qw = qweights(weights)
        if cached is None:
            cached = {"kernels": choose_kernels(qw, natives, log)}
            atomic_write_text(f, json.dumps(cached))
        info["kernels"] = cached["kernels"]
    swap_linears(model, qw, info["kernels"], natives)
    # single or paired Q4_1 tiles: measured once per machine and kernel build (on the linears just swapped in, or by
    # 'auto' on its int4 trial), kept with the rest
    pair_key, q4 = _pair_key(natives), _q4_linears(model, natives)
    if pair_key not in cached:
        cached[pair_key] = choose_q4_pair(q4, natives, log)
        atomic_write_text(f, json.dumps(cached))
    pair = cached[pair_key] if q4 else None  # (an int8 model has no Q4_1 tiles: auto's int4 choice does not apply)
    if pair is not None:
        natives.set_q4_pair(pair)
    info["q4_pair"] = pair
    info["resolved"] = weights
    info["sources"] = sorted({q.source for q in qw.values()})
    return info


def _kernel_build_key() -> str:
    from ..kernels._build import build_key  # imported here: only where the native kernels load

    return build_key()[:16]


def _pair_key(natives) -> str:
    """The tune-file key of the Q4_1 paired-tiles choice (per kernel build)."""
    return "q4_pair@" + (_kernel_build_key() if natives is not None else "")


def _q4_linears(model: torch.nn.Module, natives) -> list[NativeLinear]:
    """``model``'s native Q4_1 linears (none without the native kernels)."""
    if natives is None:
        return []
    return [m for m in model.modules() if isinstance(m, NativeLinear) and m.packed.kind == natives.Q4_1]


@contextlib.contextmanager
def _q4_tiles(natives, pair: bool | None) -> Iterator[None]:
    """The Q4_1 paired-tiles setting ``pair`` for the block (None: left as it is), then the kernel's default (paired)
    until a load applies its choice."""
    if pair is None:
        yield
        return
    natives.set_q4_pair(pair)
    try:
        yield
    finally:
        natives.set_q4_pair(True)


def _pack_fp32(model: torch.nn.Module, path: Path | None) -> None:
    """The fp32 decode path with its measured per-row-count kernel plan (when ``model`` has one)."""
    from .plan import pack_tuned

    if callable(getattr(model, "pack", None)) and path is not None:
        pack_tuned(model, path, torch.float32)


AUTO_ROUNDS = 6  # alternating timing rounds of int4 and int8 in 'auto' (the fastest of each kept)


def _measure_auto(model, qweights, natives, probe_ids, min_agreement, log, keep: dict | None = None) -> dict:
    """fp32 vs int4 vs int8 on this machine: linear time (1 + 16 rows) and top-1 agreement with fp32.

    fp32 is timed with the kernel it would run: the row-invariant ``kernels.mm_f32`` with the extension
    (models/plan.py pack_tuned), else its fastest BLAS kernel for 1 and 16 rows (a plan of just those two row counts:
    the full plan is measured only when fp32 wins). ``keep`` receives the quantized weights read here.
    """
    from .llama import Linear, tune_matmul_plan
    from .matmul import exact_plan, exact_plan_available

    fp32_mods = [m for m in model.modules() if isinstance(m, Linear)]
    unpacked = callable(getattr(model, "pack", None)) and getattr(model, "matmul_plan", None) is None
    if unpacked and fp32_mods:
        exact = exact_plan_available(fp32_mods[0].weight.dtype)
        model.pack(exact_plan() if exact else tune_matmul_plan(fp32_mods, buckets=(1, 16)))
    times = {"fp32": sum(time_modules(fp32_mods, r) for r in (1, 16))}
    if unpacked and fp32_mods:
        model.unpack()
    agree = {"fp32": 1.0}
    ids = torch.tensor(probe_ids) if probe_ids else None
    ref = None
    if ids is not None:
        with torch.inference_mode():
            ref = model.forward(ids[None], torch.arange(len(ids)))[0][0].argmax(-1)
    plans, pair, trials = {}, None, {}
    for w in ("int4", "int8"):
        qw = qweights(w)
        plans[w] = choose_kernels(qw, natives, log)
        trial = _trial_model(model, qw, plans[w], natives)
        trials[w] = [m for n, m in trial.named_modules() if n in qw]
        if w == "int4":  # timed with the Q4_1 tiles it would run with: on the session-35 Zen 4 the default paired
            # tiles took 25% longer at 8-16 rows than single ones, and 'auto' had picked the slower int8 on it
            pair = choose_q4_pair(_q4_linears(trial, natives), natives, log)
        agree[w] = _top1_agreement(trial, ids, ref) if ref is not None else 1.0
        del trial
        if keep is not None:
            keep[w] = qw
    # int4 and int8 timed in alternating rounds, the fastest round of each kept: timed one after the other (3 reps
    # each), a burst of load met one format only, and on a session-41 Xeon 'auto' chose int8 (linears 18.3 against
    # 20.2 ms) where every full forward of 1-16 rows runs faster in int4 (1 row 5.5 against 7.5 ms) and the default
    # drafter decoded 1.6x faster in int4
    for w in trials:
        times[w] = float("inf")
    for rnd in range(AUTO_ROUNDS):
        for w in ("int4", "int8") if rnd % 2 == 0 else ("int8", "int4"):
            with _q4_tiles(natives, pair if w == "int4" else None):
                t = sum(time_modules(trials[w], r, reps=1) for r in (1, 16))
            times[w] = min(times[w], t)
    del trials
    ok = [w for w in times if agree[w] >= min_agreement]
    chosen = min(ok, key=times.get)
    if log:
        log(
            f"auto -> {chosen}; linears ms (1 + 16 rows): "
            + ", ".join(f"{w} {t * 1e3:.1f} (top-1 {agree[w]:.2f})" for w, t in times.items())
        )
    return {
        "chosen": chosen,
        "kernels": plans.get(chosen, {}),
        "top1_agreement": agree,
        "linear_ms_rows_1_16": {w: t * 1e3 for w, t in times.items()},
        "kernels_by_format": plans,  # choose_kernels of each quantized format (reused by --weights int4/int8)
        _pair_key(natives): pair,  # the Q4_1 tiles int4 was timed with (applied if int4 is chosen)
    }


def _trial_model(model: torch.nn.Module, qw: dict[str, QWeight], kernels: dict[str, str], natives):
    """A shallow copy of ``model`` with quantized linears (the float model stays as it is)."""
    import copy

    trial = copy.copy(model)
    trial._modules = dict(model._modules)
    # copy the module tree down to the linears so the swap does not touch the original
    trial.layers = torch.nn.ModuleList(copy.copy(b) for b in model.layers)
    for b in trial.layers:
        b._modules = dict(b._modules)
        b.attn = copy.copy(b.attn)
        b.attn._modules = dict(b.attn._modules)
        b.ffn = copy.copy(b.ffn)
        b.ffn._modules = dict(b.ffn._modules)
    swap_linears(trial, qw, kernels, natives)
    return trial


BF16_PROBE = (512, 8)  # choose_bf16_scores: cached tokens, tree rows


def choose_bf16_scores(net, path: Path | None, log=None, reps: int = 5) -> bool:
    """Whether ``net``'s decode attention should compute its scores in bf16 on this machine: an 8-row tree step on a
    512-token cache through the fused decoder, both ways alternating, min of ``reps``, one kernel thread in its own
    CPU time (as choose_q4_pair: the other core's load on a shared machine would swamp a wall-clock A/B). The faster
    wins; the answer is cached per machine, model file and kernel build (TREEDRAFT_RETUNE=1 measures again).
    False where the fused decoder does not run ``net``, or its context cannot hold the probe (not cached: a load
    with a longer context measures)."""
    import time

    from .. import kernels as natives
    from . import fused
    from .cache import atomic_write_text
    from .registry import cache_dir

    key = "bf16_scores@" + _kernel_build_key()
    f = cache_dir() / "tune" / f"attn-{_machine_key(path, 'bf16-scores')}.json"
    cached = _read_tune(f) or {}
    if key in cached:
        return bool(cached[key])
    ctx, rows = BF16_PROBE
    ctx = min(ctx, net.config.max_seq_len - rows - 1)
    dec = fused.decoder_for(net)
    if dec is None or ctx < rows:
        return False
    g = torch.Generator().manual_seed(0)
    cache = net.new_cache(ctx + rows)
    best = {False: float("inf"), True: float("inf")}
    threads = natives.get_num_threads()
    with torch.inference_mode():
        net.forward(torch.randint(0, net.vocab_size, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        toks = torch.randint(0, net.vocab_size, (1, rows), generator=g)
        pos = torch.arange(ctx, ctx + rows)
        mask = torch.ones(rows, ctx + rows, dtype=torch.bool).tril(ctx)
        natives.set_num_threads(1)
        try:
            for _ in range(reps):
                for on in (False, True):
                    dec.set_bf16_scores(on)
                    t = time.thread_time()
                    net.forward(toks, pos, cache, ctx, mask)
                    best[on] = min(best[on], time.thread_time() - t)
        finally:
            dec.set_bf16_scores(bool(getattr(net, "bf16_scores", False)))
            natives.set_num_threads(threads)
    choice = best[True] < best[False]
    if log:
        log(f"attention scores, {rows}-row step at {ctx} tokens: float32 {best[False] * 1e3:.1f} ms, "
            f"bf16 {best[True] * 1e3:.1f} ms -> {'bf16' if choice else 'float32'}")  # fmt: skip
    cached[key] = choice
    atomic_write_text(f, json.dumps(cached))
    return choice


def log_stderr(msg: str) -> None:
    """Progress lines of the kernel choice."""
    print(f"[weights] {msg}", file=sys.stderr)


def resolve_weights(weights: str, runtime: str, device: str, dtype: torch.dtype, own_loads: bool = True) -> str:
    """Validate ``weights`` for a load: int4/int8 need the own runtime on CPU in float32 (the error names every
    setting in the way; ``own_loads`` False: the own runtime does not run this model, so nothing but the weights can
    change); auto falls back to fp32."""
    check_weights(weights)
    problems = []  # (what is in the way, the flag that changes it)
    if runtime != "own":
        problems.append((f"runtime {runtime!r}", "--runtime own (or auto)"))
    if not str(device).startswith("cpu"):
        problems.append((f"device {device!r}", "--device cpu"))
    if dtype != torch.float32:
        problems.append((f"dtype {str(dtype).removeprefix('torch.')}", "--dtype fp32 (or auto)"))
    if not problems:
        return weights
    if weights in ("int4", "int8"):
        if not own_loads:
            raise ValueError(
                f"weights {weights!r} run on the own runtime, which does not run this model's architecture; "
                "use --weights fp32 or auto"
            )
        raise ValueError(
            f"weights {weights!r} run on the own runtime on cpu in float32, not with "
            f"{' and '.join(w for w, _ in problems)}; use --weights fp32 or auto, or {' '.join(f for _, f in problems)}"
        )
    return "fp32"


PROBE_TEXT = (
    "The printing press, invented by Johannes Gutenberg around 1440, changed how ideas spread across "
    "Europe. Books became cheaper, literacy rose, and scientists could share results quickly."
)
