"""Replay prompt-lookup settings offline on greedy outputs a bench already produced.

Greedy decoding is deterministic, so whether a chain draft is accepted is fixed by the final
output: the accepted length is the common prefix of the draft and what the model wrote next.
This replays the real :class:`PromptLookupDrafter` over the ``plain`` records of a bench run and
prices every step with a forward-latency table (tree tokens -> ms), so drafter settings can be
compared in seconds instead of a 50-minute bench. ``--medusa-accept`` adds one Medusa node per
step, accepted with that probability when the lookup branch misses at depth 1 (an approximation
of the hybrid drafter; the heads themselves need the target's hidden states).

    python benchmarks/lookup_replay.py benchmarks/results/bench-mtbench80-before/records.json

The replay's fixed-3-token hybrid figure (mean accepted 2.06) matched that bench exactly; its
tokens/s ratios are rougher, because the latency table leaves out the per-step overhead.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.interfaces import DraftContext

# one forward of k tokens on a 512-token cache, ms (treedraft calibrate on this 2-core CPU, fp32)
LATENCY_MS = {1: 26.0, 2: 28.2, 4: 40.2, 8: 58.7, 16: 83.5, 32: 121.4, 64: 215.1}


def latency(n: int, table: dict[int, float]) -> float:
    """Linear interpolation of the table (n within its range)."""
    ks = sorted(table)
    lo = max(k for k in ks if k <= n)
    hi = min(k for k in ks if k >= n)
    return table[lo] if lo == hi else table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def replay(
    data: list[tuple[list[int], list[int]]],
    drafter: PromptLookupDrafter,
    medusa_accept: float,
    draft_ms: float,
    step_ms: float,
) -> tuple[float, float]:
    """(tokens/s, mean accepted length incl. bonus) of the drafter over (prompt, output) pairs."""
    rnd = random.Random(0)
    tokens = steps = 0
    ms = 0.0
    for prompt, out in data:
        i = 0  # out[i] is the root: the token the target already chose
        while i < len(out) - 1:
            ctx = prompt + out[: i + 1]
            tree = drafter.propose(DraftContext(ctx, None, max_nodes=64, max_depth=len(out) - 1 - i))
            draft = list(tree.tokens[1:])
            a = 0
            while a < len(draft) and draft[a] == out[i + 1 + a]:
                a += 1
            n = len(tree)
            if medusa_accept > 0:
                n += 1
                if a == 0 and rnd.random() < medusa_accept:
                    a = 1
            ms += latency(n, LATENCY_MS) + draft_ms + step_ms
            tokens += a + 1
            steps += 1
            i += a + 1
    return tokens / ms * 1e3, tokens / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", type=Path, help="records.json of a treedraft bench run with a 'plain' method")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--questions",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl",
    )
    p.add_argument("--medusa-accept", type=float, default=0.33, help="0 = prompt lookup alone")
    p.add_argument("--draft-ms", type=float, default=1.1)
    p.add_argument("--step-ms", type=float, default=1.5, help="per-step overhead outside the forward")
    a = p.parse_args()

    from treedraft.api import load

    llm = load(a.model, drafter=None)
    turns = {str(q["question_id"]): q["turns"][0] for q in map(json.loads, a.questions.read_text().splitlines())}
    recs = [r for r in json.loads(a.records.read_text())["records"] if r["method"] == "plain"]
    data = [(llm.encode_prompt(turns[r["prompt_id"]]), r["token_ids"]) for r in recs]
    plain = 1e3 / (LATENCY_MS[1] + a.step_ms)
    settings = {
        "fixed 2": PromptLookupDrafter(adaptive=False, num_tokens=2),
        "fixed 3": PromptLookupDrafter(adaptive=False, num_tokens=3),
        "fixed 6": PromptLookupDrafter(adaptive=False, num_tokens=6),
        "adaptive, max 6": PromptLookupDrafter(max_tokens=6),
        "adaptive, max 12 (default)": PromptLookupDrafter(),
    }
    print(f"{len(data)} answers; plain {plain:.1f} tok/s (model)")
    print("| setting | tok/s | x plain | mean accepted |\n|---|---|---|---|")
    for name, d in settings.items():
        tps, mal = replay(data, d, a.medusa_accept, a.draft_ms if a.medusa_accept else 0.0, a.step_ms)
        print(f"| {name} | {tps:.1f} | {tps / plain:.2f} | {mal:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
