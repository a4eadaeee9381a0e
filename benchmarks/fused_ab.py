"""The fused native decode step, this tree's kernels vs a baseline copy, side by side in one process.

Builds ``--baseline DIR`` (a copy of an older ``src/treedraft/kernels``, e.g.
``git archive <rev> src/treedraft/kernels | tar -x -C /tmp/base``; see benchmarks/mm_ab.py) as a second
extension, builds a ``FusedDecoder`` of the bundled model from each, then runs the same k-row decode
forwards (k = 1 and a 16-node binary tree by default) on top of a ``--context``-token KV cache with the
two interleaved per repetition. Checks that both give bitwise equal logits and hidden states, prints
median / min ms per forward and base/new, and the per-phase split of each (C++ phase timers).
``--tunings 4096:16384,8192:16384,...``: also time the new build at these (prefetch bytes : smallest work
unit bytes) settings of ``treedraft.kernels.set_tuning`` (no effect on bits), as variants ``new@PF:UNIT``.
``--busy``: also time every forward while a spinning process keeps one core busy (blocks of reps with
and without it, alternating) and print busy/quiet per build.

    python benchmarks/fused_ab.py --baseline /tmp/base/src/treedraft/kernels [--context 512] [--reps 40]
        [--busy] [--tunings 0:16384,8192:16384,4096:65536] [--kv-dtype float16] [--batch 8]
        [--threads 1 --clock thread]

Run on branch rt2 (base = its parent commit d9f2bbb's kernels) on the 2-core Xeon at load average 13-15:
bitwise equal for k = 1 and 16 and every tuning; timings were dominated by the other jobs (1-row forwards
from 22 to 160 ms against ~10.7 ms quiet), so no speed claim is made from them: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from fused_latency import depths, tree_mask  # benchmarks/ is on sys.path when run as a script
from mm_ab import load_baseline

import treedraft
import treedraft.kernels as tk
from treedraft.models import fused

PHASES = ["other", "qkv", "attention", "wo", "w13", "w2", "lm_head"]


class Recorder:
    """Stands in for the decoder during one model.forward to capture the native call's arguments."""

    def __init__(self, dec: object) -> None:
        self.dec, self.args = dec, None

    def forward(self, *args: object) -> object:
        """Record, then delegate."""
        self.args = args
        return self.dec.forward(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="kernel source dir or built .so")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--ks", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: the caller's CPU time (with --threads 1 all kernel work; other processes do not count)",
    )
    ap.add_argument("--kv-dtype", choices=["float32", "float16"], default="float32", help="KV cache storage")
    ap.add_argument("--busy", action="store_true", help="also time with one core kept busy by a spinner")
    ap.add_argument("--tunings", default="", help="PF:UNIT,... variants of the new build (set_tuning bytes)")
    ap.add_argument(
        "--batch", type=int, default=0, help="also N caches x 1 row in one packed forward (the batched server's step)"
    )
    a = ap.parse_args()
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    tk.set_num_threads(a.threads)
    llm = treedraft.load(drafter=None, weights=a.weights)
    m = llm.model
    st = fused._state(m)
    if st.decoder is None:
        raise SystemExit(f"no fused decoder: {st.reason}")
    base_mod = load_baseline(a.baseline, a.threads)
    real_ext = tk._ext
    tk._ext = lambda: base_mod
    try:
        base_dec = fused._build(m, fused._deps(m)).decoder
    finally:
        tk._ext = real_ext
    decs = {"base": base_dec, "new": st.decoder}
    tune: dict[str, tuple[int, int]] = {}
    if a.tunings:
        tune["new"] = tk.set_tuning()  # the build's defaults
        for t in a.tunings.split(","):
            pf, unit = (int(x) for x in t.split(":"))
            decs[f"new@{t}"] = st.decoder
            tune[f"new@{t}"] = (pf, unit)

    def fwd(n: str, k: int):
        if n in tune:
            tk.set_tuning(*tune[n])
        return decs[n].forward(*calls[k])

    V, ctx = m.vocab_size, a.context
    g = torch.Generator().manual_seed(0)
    m.kv_dtype = getattr(torch, a.kv_dtype)
    cache = m.new_cache(ctx + 128)
    ks = [int(k) for k in a.ks.split(",")]
    calls = {}
    with torch.inference_mode():
        m.forward(torch.randint(0, V, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        cache.keep(0, range(ctx))
        toks = torch.randint(0, V, (1, max(ks)), generator=g)
        for k in ks:
            rec = Recorder(st.decoder)
            st.decoder = rec
            pos = torch.tensor([ctx + d for d in depths(k)])
            m.forward(toks[:, :k], pos, cache, ctx, None if k == 1 else tree_mask(k, ctx))
            st.decoder = rec.dec
            calls[k] = rec.args
        if a.batch:  # N requests' caches of ctx tokens each, one new row per request, one packed forward
            from treedraft.models.llama import Segment

            caches = []
            for _ in range(a.batch):
                c = m.new_cache(ctx + 8)
                m.forward(torch.randint(0, V, (1, ctx), generator=g), torch.arange(ctx), c, 0)
                c.keep(0, range(ctx))
                caches.append(c)
            rec = Recorder(st.decoder)
            st.decoder = rec
            m.forward_packed(
                torch.randint(0, V, (a.batch,), generator=g),
                torch.full((a.batch,), ctx),
                [Segment(c, ctx, 1, None) for c in caches],
            )
            st.decoder = rec.dec
            ks.append(f"{a.batch}x1")
            calls[ks[-1]] = rec.args
        for k in ks:
            lb, hb = fwd("base", k)
            for n in list(decs)[1:]:
                ln, hn = fwd(n, k)
                same = torch.equal(lb, ln) and torch.equal(hb, hn)
                print(
                    f"k={k}: base and {n} bitwise equal: {same}" + ("" if same else f" ({(lb - ln).abs().max():.3g})")
                )
        times = {(n, k, busy): [] for busy in ((False, True) if a.busy else (False,)) for k in ks for n in decs}
        keys = [(n, k) for k in ks for n in decs]
        for _ in range(3):
            for n, k in keys:
                fwd(n, k)
        block = 5
        for rep in range(0, a.reps, block):
            for busy in (False, True) if a.busy else (False,):
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                try:
                    if hog:
                        time.sleep(0.05)
                    for r in range(rep, min(a.reps, rep + block)):
                        for n, k in keys if r % 2 == 0 else reversed(keys):
                            t0 = clock()
                            fwd(n, k)
                            times[(n, k, busy)].append(clock() - t0)
                finally:
                    if hog:
                        hog.kill()
                        hog.wait()
        phases = {}
        for d in decs.values():
            d.set_profile(True)
        for k in ks:
            for n in decs:
                decs[n].take_timings()
                for _ in range(a.reps):
                    fwd(n, k)
                phases[(n, k)] = [t / a.reps for t in decs[n].take_timings()]
        for d in decs.values():
            d.set_profile(False)
    print(
        f"\n{a.weights}, {a.kv_dtype} KV, context {ctx}, {a.threads} threads, {a.reps} reps interleaved; "
        f"{a.clock} ms median / min"
    )
    for busy in (False, True) if a.busy else (False,):
        print(f"\n{'one core busy' if busy else 'quiet'}:")
        print("| rows | build | median / min ms | base/build (median) |")
        print("|---|---|---|---|")
        for k in ks:
            mb = statistics.median(times[("base", k, busy)])
            for n in decs:
                t = times[(n, k, busy)]
                mn = statistics.median(t)
                print(f"| {k} | {n} | {mn * 1e3:.2f} / {min(t) * 1e3:.2f} | {mb / mn:.3f}x |")
    if a.busy:
        print("\nbusy/quiet (median; worst = p90 busy / median quiet):")
        for k in ks:
            for n in decs:
                q, b = times[(n, k, False)], times[(n, k, True)]
                mq = statistics.median(q)
                p90 = sorted(b)[int(0.9 * (len(b) - 1))]
                print(f"  rows {k} {n}: {statistics.median(b) / mq:.2f}x, p90 {p90 / mq:.2f}x")
    print("\nmean ms per phase (profiled runs, one build after the other):")
    print("| rows | build | " + " | ".join(PHASES) + " | total |")
    print("|---" * (len(PHASES) + 3) + "|")
    for k in ks:
        for n in decs:
            ph = phases[(n, k)]
            print(f"| {k} | {n} | " + " | ".join(f"{t:.3f}" for t in ph) + f" | {sum(ph):.2f} |")


if __name__ == "__main__":
    main()
