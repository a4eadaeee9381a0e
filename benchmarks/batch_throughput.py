"""Aggregate throughput of the batched loop at concurrency 1 vs 8, in one process, interleaved and repeated.

Mirrors ``treedraft loadtest`` without HTTP: N MT-Bench prompts (chat template, greedy, EOS ignored) go
through one :class:`~treedraft.scheduler.Scheduler` with the server's settings (``step_rows`` from the
latency curve unless given, ``prefill_chunk`` 256); at concurrency c at most c requests are active and a
finished one is replaced by the next prompt at the next step (the load test's c clients). Runs of each
concurrency alternate (c1, c8, c1, c8, ...), so machine noise hits both alike; the ratio is the number to
read. Per run: tokens/s, steps, rows per step, mean accepted length, and where the step time went:

    native    FusedDecoder.forward (the decode steps' whole transformer, timed around the C++ call)
    prefill   prompt chunks (Python forward) = forward - native
    draft     drafters' propose + tree checks, masks, positions
    commit    acceptance, sampling, KV compaction, bookkeeping
    plan      the rest of planning (budgets, chunking)
    text      detokenization through the server's TextStream (``--text``)
    other     the loop around it (wall - all of the above)

``modeled tok/s``: tokens / the sum over steps of the latency curve at the step's rows (``--model-latency``,
default a quiet Skylake Xeon's): the forward time this run's steps would take there, free of this machine's noise
(prefill rows priced like decode rows, which flatters the Python prefill of ``old``).

``--memory fresh`` (default): every run's suffix index starts empty (its own tenant), so a run never drafts
from an earlier run's answers. ``--memory shared``: one index for all runs. ``--memory loadtest``: what
``treedraft loadtest`` does to a fresh server, per variant and round: one warm-up request (prompt 0), then
each level in order (c1, then c8) on one index; the load test sends the same prompts at every level, so the
c8 level drafts from the c1 level's answers.

    python benchmarks/batch_throughput.py [--weights int4] [--tokens 256] [--prompts 8]
        [--concurrency 1,8] [--rounds 2] [--step-rows N] [--drafter default] [--memory fresh|shared] [--text]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from step_overhead import TimedDecoder  # this folder is on sys.path when run as a script

import treedraft
from treedraft.budget import interpolate
from treedraft.engine import GenerationConfig, GenerationStats
from treedraft.models import fused
from treedraft.prefix_cache import PrefixCache
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file
from treedraft.scheduler import Scheduler, measured_latency, measured_step_rows


def install_timer(model: torch.nn.Module) -> TimedDecoder | None:
    """Wrap the model's native decoder so every decode forward is timed (None: no fused decoder here)."""
    st = fused._state(model)
    if st.decoder is None:
        print(f"note: no fused decoder ({st.reason}); 'native' stays 0", file=sys.stderr)
        return None
    if not isinstance(st.decoder, TimedDecoder):
        st.decoder = TimedDecoder(st.decoder)
    return st.decoder


@dataclass
class Run:
    """Totals of one run (one concurrency level over the prompts)."""

    c: int
    wall: float = 0.0
    tokens: int = 0
    steps: int = 0
    rows: int = 0
    decode_rows: int = 0
    decode_steps: int = 0  # steps without prefill rows
    native: float = 0.0
    forward: float = 0.0
    draft: float = 0.0
    commit: float = 0.0
    plan: float = 0.0
    text: float = 0.0
    modeled: float = 0.0  # seconds the forwards would take on the given latency curve (--latency)
    verify_steps: int = 0  # per-request verify steps (for the mean accepted length)
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        """The printed summary (ms per step for the split)."""
        s = max(1, self.steps)
        ms = {k: round(1000 * getattr(self, k) / s, 2) for k in ("native", "draft", "commit", "plan", "text")}
        ms["prefill"] = round(1000 * (self.forward - self.native) / s, 2)
        other = self.wall - self.forward - self.draft - self.commit - self.plan - self.text
        ms["other"] = round(1000 * other / s, 2)
        return {
            "c": self.c,
            "tok/s": round(self.tokens / self.wall, 1),
            "modeled tok/s": round(self.tokens / self.modeled, 1),
            "wall_s": round(self.wall, 2),
            "steps": self.steps,
            "rows/step": round(self.rows / s, 2),
            "decode rows/step": round(self.decode_rows / max(1, self.decode_steps), 2),
            "mean accepted": round((self.accepted + self.verify_steps) / max(1, self.verify_steps), 3),
            "step ms": round(1000 * self.wall / s, 2),
            **{f"{k} ms": v for k, v in ms.items()},
        }


def run_level(
    llm: object,
    prompts: list[list[int]],
    c: int,
    cfg: GenerationConfig,
    drafter: object,
    step_rows: int,
    latency: dict[int, float] | None,
    timer: TimedDecoder | None,
    tenant: str,
    text: bool,
    native_prefill: bool = True,
    curve: dict[int, float] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Run:
    """Decode every prompt with at most ``c`` active requests (the next joins as one finishes)."""
    eng = llm.engine
    curve = curve or latency or {1: 1.0}
    sched = Scheduler(eng, step_rows=step_rows, prefill_chunk=256, latency=latency, native_prefill=native_prefill)
    sched.prefix_cache = prefix_cache  # shared by the levels of one variant (as one server's)
    run, queue = Run(c), list(range(len(prompts)))
    out: dict[int, list[int]] = {}
    streams: dict[object, object] = {}
    if timer is not None:
        timer.seconds = 0.0

    def admit() -> None:
        while queue and len(sched.active) < c:
            i = queue.pop(0)
            d = drafter.for_tenant(tenant) if callable(getattr(drafter, "for_tenant", None)) else drafter
            stats = GenerationStats()
            req = sched.add(prompts[i], cfg, d, stats, tag=i)
            if text:
                streams[req] = llm.text.text_stream(cfg, req.max_new, stats)

    t0 = time.perf_counter()
    with torch.inference_mode():
        admit()
        while sched.active:
            events = sched.step()
            st = sched.last_step
            run.steps += 1
            run.rows += st.rows
            run.modeled += interpolate(curve, st.rows) if st.rows else 0.0  # (a step of cached first tokens only)
            if st.prefill_rows == 0:
                run.decode_steps += 1
                run.decode_rows += st.rows
            run.forward += st.t_forward
            run.draft += st.t_draft
            run.commit += st.t_commit
            run.plan += st.t_plan
            tt = time.perf_counter()
            for req, new in events:
                if req.error is not None:
                    raise req.error
                if text:
                    streams[req].feed(new)
            run.text += time.perf_counter() - tt if text else 0.0
            for req in [r for r in sched.active if r.done]:
                sched.remove(req)
                out[req.tag] = req.output()
                run.tokens += len(out[req.tag])
                run.verify_steps += len(req.stats.steps)
                run.accepted += sum(s.accepted for s in req.stats.steps)
            admit()
    run.wall = time.perf_counter() - t0
    run.native = timer.seconds if timer is not None else 0.0
    run.outputs = [out[i] for i in range(len(prompts))]
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-rows", type=int, default=None, help="default: measured, as the server does")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--memory", choices=("fresh", "shared", "loadtest"), default="fresh")
    ap.add_argument("--text", action="store_true", help="detokenize through the server's TextStream")
    ap.add_argument(
        "--variants",
        default="old,new",
        help="comma list: old (equal row shares, Python prefill), native (equal shares, native prefill), "
        "new (latency-curve row budget, native prefill), prefix (new + a prefix cache, as serve's default)",
    )
    ap.add_argument(
        "--latency",
        default=None,
        help="latency curve for the budget, 'rows:ms,...'; default: measured here (as the server does; on a busy "
        "machine keep it so: the budget weighs it against drafting times measured under the same load)",
    )
    ap.add_argument(
        "--model-latency",
        default="1:10.8,2:11.9,4:19.1,8:29.3,16:51.8",
        help="latency curve 'rows:ms,...' for the modeled tok/s column (default: the quiet Skylake Xeon's, int4)",
    )
    a = ap.parse_args()

    llm = treedraft.load(weights=a.weights)
    model = llm.engine.model
    data = find_shared_data(MT_BENCH_FILE) or "/work/shared/data/" + MT_BENCH_FILE
    texts = [p.text for p in read_prompt_file(data)][: a.prompts]
    prompts = [llm.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    rows = a.step_rows or measured_step_rows(model)

    def curve(spec: str) -> dict[int, float]:
        return {int(k): float(v) / 1000 for k, v in (x.split(":") for x in spec.split(","))}

    lat = curve(a.latency) if a.latency else measured_latency(model)
    model_lat = curve(a.model_latency)
    print("latency curve (ms):", {k: round(v * 1000, 1) for k, v in sorted(lat.items())})
    drafter = llm.get_drafter(a.drafter) if a.drafter not in ("none", "plain") else None
    cfg = GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True)
    timer = install_timer(model)
    levels = [int(x) for x in a.concurrency.split(",")]
    print(
        f"weights {a.weights}, drafter {getattr(drafter, 'name', None)}, step_rows {rows}, "
        f"threads {torch.get_num_threads()}, {len(prompts)} prompts x {a.tokens} tokens, memory {a.memory}",
        flush=True,
    )
    run_level(llm, prompts[:1], 1, GenerationConfig(max_new_tokens=8), drafter, rows, None, timer, "warm-up", False)
    variants = {"old": (False, False), "native": (False, True), "new": (True, True), "prefix": (True, True)}
    modes = [(c, v) for v in a.variants.split(",") for c in levels]
    by_mode: dict[tuple[int, str], list[Run]] = {m: [] for m in modes}
    refs: dict[bool, list[list[int]]] = {}  # greedy: runs with the same prefill arithmetic give the same tokens
    for r in range(a.rounds):
        if a.memory == "loadtest":  # per variant: warm-up request, then the levels in order, on one index
            vs = a.variants.split(",")
            order = [(c, v) for v in (vs if r % 2 == 0 else vs[::-1]) for c in levels]
        else:
            order = modes if r % 2 == 0 else modes[::-1]
        warmed: set[str] = set()
        caches: dict[str, PrefixCache] = {}  # per variant and round ('prefix'; --memory fresh: per run)
        for c, v in order:
            budget, native = variants[v]
            tenant = {"shared": "", "fresh": f"run-{r}-{c}-{v}", "loadtest": f"run-{r}-{v}"}[a.memory]
            lt = lat if budget else None
            pc = None
            if v == "prefix":
                pc = caches.setdefault(tenant, PrefixCache(256 << 20, 64))
            if a.memory == "loadtest" and v not in warmed:
                warmed.add(v)
                run_level(llm, prompts[:1], 1, cfg, drafter, rows, lt, timer, tenant, False, native, None, pc)
            run = run_level(llm, prompts, c, cfg, drafter, rows, lt, timer, tenant, a.text, native, model_lat, pc)
            if refs.setdefault(native, run.outputs) != run.outputs:
                print(f"MISMATCH: round {r} c={c} {v}: outputs differ from an earlier run", flush=True)
            by_mode[(c, v)].append(run)
            print(json.dumps({"round": r, "variant": v, **run.row()}), flush=True)
    for v in a.variants.split(","):
        base = by_mode[(levels[0], v)]
        for c in levels[1:]:
            ratios = [b.tokens / b.wall / (x.tokens / x.wall) for x, b in zip(base, by_mode[(c, v)])]
            print(
                f"{v}: c{c} / c{levels[0]}: median {statistics.median(ratios):.2f}x over {len(ratios)} rounds "
                f"({', '.join(f'{x:.2f}' for x in ratios)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
