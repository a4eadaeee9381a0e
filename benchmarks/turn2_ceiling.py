"""How fast could any copy-drafting default decode MT-Bench second turns on this CPU? An optimistic bound (issue 13).

For the first ``--prompts`` MT-Bench questions: plain greedy answers turn 1, then turn 2 (both int4, greedy: the
output every method must reproduce). At each position i of the second answer, L_i = the longest run
answer[i : i + L] that occurs in (prompt + answer[:i]) (copy runs, LZ77-style). An oracle that knows the output
then decodes at the cheapest mix of
  - copy steps: a chain of l <= L_i drafted rows, all accepted, + the bonus token: l + 1 tokens for lat(1 + l);
  - novel tokens: at ``--novel-ms`` per token (default: plain decoding's measured second-turn ms/token divided
    by the default's measured first-turn speedup over plain, i.e. first-turn drafting where nothing is copied);
with ``lat`` this machine's forward latency by rows, measured at ``--context`` tokens (about a second turn's
mean: 20 second turns hold 640-1,100 tokens), no drafting time and no per-step overhead. If even this
bound misses a target, better suffix drafting cannot reach it on this CPU. Side by side, in the same process:
the measured decode ms/token (step timings, prefill excluded) of plain decoding, the default and ``hybrid`` on
the same second turns (each output checked equal to plain's).

    python benchmarks/turn2_ceiling.py [--prompts 20] [--max-new 256] [--context 512] [--novel-ms MS]
"""

from __future__ import annotations

import argparse
import json
import statistics

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data
from treedraft.training.calibrate import measure_latency


def copy_runs(context: list[int], answer: list[int]) -> list[int]:
    """L_i for every i: longest prefix of answer[i:] found contiguous in context + answer[:i]."""
    out = []
    for i in range(len(answer)):
        text = context + answer[:i]
        best, first = 0, answer[i]
        for s, t in enumerate(text):
            if t != first:
                continue
            n = 0
            while s + n < len(text) and i + n < len(answer) and text[s + n] == answer[i + n]:
                n += 1
            best = max(best, n)
        out.append(best)
    return out


def oracle_ms(runs: list[int], lat: dict[int, float], novel_ms: float, min_run: int = 1) -> float:
    """Cheapest decode time (ms) of the whole answer under the model in the module docstring; copy steps only
    where the run is at least ``min_run`` long (shorter ones: which occurrence continues is a guess)."""
    n, max_rows = len(runs), max(lat)
    cost = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best = novel_ms + cost[i + 1]
        for ell in range(1, min(runs[i] if runs[i] >= min_run else 0, max_rows - 1) + 1):
            j = min(n, i + ell + 1)
            best = min(best, 1e3 * lat[1 + ell] + cost[j])
        cost[i] = best
    return cost[0]


def questions(start: int, count: int) -> list[dict]:
    """MT-Bench questions ``start`` .. ``start + count - 1`` from ../shared/data (SystemExit when it is missing)."""
    data = find_shared_data(MT_BENCH_FILE)
    if data is None:
        raise SystemExit(f"needs ../shared/data/{MT_BENCH_FILE} beside the checkout")
    return [json.loads(line) for line in open(data)][start : start + count]


def second_turn(llm, q: dict, max_new: int) -> tuple:
    """(plain greedy first answer, the second turn's messages with it in the context) of an MT-Bench question."""
    first = llm.generate([{"role": "user", "content": q["turns"][0]}], drafter=None, max_new_tokens=max_new)
    conv = [
        {"role": "user", "content": q["turns"][0]},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": q["turns"][1]},
    ]
    return first, conv


def add_ab_args(ap: argparse.ArgumentParser, methods: str, prompts: int = 10, seeded: bool = True) -> None:
    """The arguments the side-by-side A/B scripts share: weights, questions, tokens, turn, methods (and, ``seeded``,
    the seed of their shuffled order)."""
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--start", type=int, default=0, help="first question index")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--turn", type=int, choices=(1, 2), default=1)
    ap.add_argument("--methods", default=methods)
    if seeded:
        ap.add_argument("--seed", type=int, default=0)


def ab_prompts(llm, a: argparse.Namespace) -> list[list[int]]:
    """Token ids of questions ``a.start`` .. (``a.prompts`` of them): first turns, or with ``a.turn == 2`` the second
    turns with the model's own greedy first answer (``a.tokens`` long) in the context."""
    qs = questions(a.start, a.prompts)
    if a.turn == 2:
        return [llm.encode_prompt(second_turn(llm, q, a.tokens)[1]) for q in qs]
    return [llm.encode_prompt([{"role": "user", "content": q["turns"][0]}]) for q in qs]


def decode_s(r) -> float:
    """Decode seconds of a generation (its steps' drafting, verify and the rest; prefill excluded)."""
    return sum(s.t_draft + s.t_verify + s.t_rest for s in r.stats.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--max-rows", type=int, default=32)
    ap.add_argument("--novel-ms", type=float, default=None, help="ms per novel token (default: measured, see above)")
    a = ap.parse_args()
    llm = treedraft.load(weights="int4")
    lat = measure_latency(llm.model, a.context, list(range(1, a.max_rows + 1)), reps=5)
    print("latency ms by rows:", {k: round(1e3 * v, 2) for k, v in lat.items() if k in (1, 2, 4, 8, 16, 32)})
    qs = [json.loads(line) for line in open(find_shared_data(MT_BENCH_FILE))][: a.prompts]
    convs, novel = [], []
    timed = {m: [0.0, 0] for m in ("plain", "default", "hybrid")}

    for q in qs:
        first, conv = second_turn(llm, q, a.max_new)
        r1 = llm.generate([{"role": "user", "content": q["turns"][0]}], max_new_tokens=a.max_new)  # the default
        novel.append((decode_s(first) / len(first.token_ids), decode_s(r1) / len(r1.token_ids)))
        second = llm.generate(conv, drafter=None, max_new_tokens=a.max_new)
        for m in timed:
            r = (
                second
                if m == "plain"
                else llm.generate(conv, drafter=fresh_copy(llm.get_drafter(m)), max_new_tokens=a.max_new)
            )
            if list(r.token_ids) != list(second.token_ids):
                raise SystemExit(f"{m}: output differs from plain decoding")
            timed[m][0] += decode_s(r)
            timed[m][1] += len(r.token_ids)
        convs.append((llm.encode_prompt(conv), list(second.token_ids)))
    first_speedup = sum(p for p, _ in novel) / sum(d for _, d in novel)  # mean per-token times, first turns
    plain_ms = 1e3 * timed["plain"][0] / timed["plain"][1]
    novel_ms = a.novel_ms or plain_ms / first_speedup
    runs = [copy_runs(ctx, ans) for ctx, ans in convs]
    flat = [r for rs in runs for r in rs]
    tot_tok = len(flat)
    print(
        f"{len(convs)} second turns, {tot_tok} tokens; default on first turns {first_speedup:.2f}x plain: "
        f"novel tokens at {novel_ms:.3f} ms/token"
    )
    print(
        f"positions with a copy run of >= 4: {sum(r >= 4 for r in flat) / tot_tok:.1%}; median L_i {statistics.median(flat)}"
    )
    for m, (t, n) in timed.items():
        ms = 1e3 * t / n
        print(f"measured {m}: {ms:.3f} ms/token = {plain_ms / ms:.2f}x plain")
    for m in (1, 4, 8, 16):
        ms = sum(oracle_ms(rs, lat, novel_ms, m) for rs in runs) / tot_tok
        print(f"oracle bound, copy steps on runs >= {m}: {ms:.3f} ms/token = {plain_ms / ms:.2f}x plain")


if __name__ == "__main__":
    main()
