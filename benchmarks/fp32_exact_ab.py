"""fp32 weights: the row-invariant plan (kernels.mm_f32 + exact attention) against the tuned BLAS plan (+ SDPA).

Side by side in one process (the two plans alternate per repetition): the forward latency of 1, 4 and 16 rows on a
512-token cache (median of 5 rounds) and plain greedy decoding tokens/s (median of 3). Session 16, AMD EPYC Zen 4,
2 threads, the exact plan through the fused step, three runs: 1 / 4 / 16 rows 21.5-23.8 / 24.8-28.7 / 57.3-65.1 ms
against 29.2-46.4 / 38.2-62.9 / 79.5-113.1 ms; plain 38.0-44.3 against 19.9-27.2 tok/s.

    python benchmarks/fp32_exact_ab.py
"""

import statistics

import treedraft
from treedraft.models.matmul import Linear, exact_plan, tune_matmul_plan
from treedraft.training.calibrate import measure_latency


def main() -> None:
    llm = treedraft.load(weights="fp32", drafter=None)
    m = llm.engine.model
    tuned = tune_matmul_plan([x for x in m.modules() if isinstance(x, Linear)])
    print("tuned BLAS plan:", sorted(set(tuned.values())))

    def use(v: str) -> None:
        m.pack(exact_plan() if v == "exact" else tuned)
        m.exact_attention = v == "exact"

    res: dict[str, dict[int, list[float]]] = {v: {1: [], 4: [], 16: []} for v in ("exact", "blas")}
    for _ in range(5):
        for v in res:
            use(v)
            lat = measure_latency(m, 512, [1, 4, 16], reps=3)
            for k in (1, 4, 16):
                res[v][k].append(1e3 * lat[k])
    for v, r in res.items():
        med = {k: round(statistics.median(x), 2) for k, x in r.items()}
        print(f"{v}: forward ms by rows {med}, 16 / 1 = {med[16] / med[1]:.2f}")
    msg = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    tps: dict[str, list[float]] = {"exact": [], "blas": []}
    for _ in range(3):
        for v in tps:
            use(v)
            r = llm.generate(msg, drafter=None, max_new_tokens=96)
            tps[v].append(len(r.token_ids) / sum(s.t_draft + s.t_verify + s.t_rest for s in r.stats.steps))
    print("plain decode tok/s (median of 3):", {v: round(statistics.median(x), 1) for v, x in tps.items()})


if __name__ == "__main__":
    main()
