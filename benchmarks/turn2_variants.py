"""Variants of the default drafter on MT-Bench second turns, side by side in one process (issue 13).

Each variant is hybrid-suffix rebuilt with one thing changed; all run on the same conversations (first turn by
plain greedy decoding), outputs checked equal to plain's, decode ms/token from the steps' timings (prefill
excluded), interleaved per conversation so the host's drift hits every variant alike. ``--rounds`` repeats
the whole pass (medians of the per-round ratios are printed too).

    python benchmarks/turn2_variants.py [--prompts 20] [--rounds 2] [--variants default,mm3,...] [--turn 1]
    python benchmarks/turn2_variants.py --history 5 --prompts 6   # long conversations (~1,000-1,800 tokens)

Variants: default, hybrid (the reference), plain, mm2 / mm3 (suffix min_match 2 / 3: short matches draft
nothing, the heads take those steps), curve800 (every sizing priced on a latency curve measured at an
800-token context instead of the cached 256-token one), flat (every sizing on the 256-token curve whatever
the context, as before session 15's ContextLatency), unpaid (the heads always draft their priced tree),
eagle / eagle-mm2 (hybrid-eagle: EAGLE in the heads' place, suffix min_match 1 / 2), eagle-free (hybrid-eagle with
EAGLE not paid: its own curve-sized tree whenever the suffix chain does not lead), eagle-only (the EAGLE drafter alone).
"""

from __future__ import annotations

import argparse
import json
import statistics

from turn2_ceiling import decode_s, second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import HybridDrafter, fresh_copy
from treedraft.drafters.registry import DrafterOptions, _eagle, _medusa, draft_cost_on_curve, suffix_sizing
from treedraft.drafters.suffix import make_suffix_drafter
from treedraft.prompts import MT_BENCH_FILE, find_shared_data
from treedraft.training.calibrate import latency_sizes, measure_latency


def build(llm, name: str, curve800: dict[int, float]):
    """The variant drafter ``name`` for ``llm``'s target (None = plain decoding)."""
    if name == "plain":
        return None
    if name in ("default", "hybrid"):
        return llm.get_drafter("hybrid-suffix" if name == "default" else "hybrid")
    target = llm.engine.model
    opts = DrafterOptions(llm.model_name, llm.heads)
    sizing = suffix_sizing(target)
    if name == "curve800":  # (the curve at --curve-context; the heads' draft cost on its scale too)
        sizing["latency"] = curve800
    if name == "flat":  # one curve for every context (before session 15): the measured 256-token one
        sizing["latency"] = dict(sizing["latency"])
    mm = 2 if name.endswith("mm2") else 3 if name.endswith("mm3") else 1
    suffix = make_suffix_drafter(None, "", min_match=mm, **sizing)
    if name == "eagle-only":
        return _eagle(target, None, opts)
    if name.startswith("eagle"):  # hybrid-eagle: the EAGLE drafter in the heads' place, paid the same way
        # (eagle-free: not paid: EAGLE sizes its own tree on its curve whenever the suffix chain does not lead)
        latency = None if name == "eagle-free" else sizing["latency"]
        return HybridDrafter(
            [_eagle(target, None, opts), suffix], name=f"hybrid-eagle[{name}]", lead_extra=0, latency=latency
        )
    medusa = _medusa(target, None, opts)
    latency = sizing["latency"]
    medusa.draft_cost = draft_cost_on_curve(target, medusa, latency)
    return HybridDrafter(
        [medusa, suffix], name=f"hybrid-suffix[{name}]", lead_extra=0, latency=None if name == "unpaid" else latency
    )


def main() -> None:
    """Print ms/token per variant and x hybrid per round."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="plain,hybrid,default,mm2,mm3,curve800")
    ap.add_argument("--curve-context", type=int, default=800, help="the context of the curve800 variant's curve")
    ap.add_argument("--turn", type=int, choices=(1, 2), default=2, help="1: the first turns themselves (short context)")
    ap.add_argument(
        "--history", type=int, default=0, help="instead: N earlier first turns (plain answers) before a new question"
    )
    a = ap.parse_args()
    names = a.variants.split(",")
    llm = treedraft.load(weights="int4")
    target = llm.engine.model
    lat = measure_latency(target, a.curve_context, latency_sizes(64), reps=5)
    print(f"curve at {a.curve_context}:", {k: round(1e3 * v, 2) for k, v in lat.items()}, flush=True)
    drafters = {n: build(llm, n, lat) for n in names}
    qs_all = [json.loads(line) for line in open(find_shared_data(MT_BENCH_FILE))]
    qs = qs_all[: a.prompts]
    if a.history:  # long conversations: N earlier questions with their plain answers, then a new question
        convs = []
        for c in range(a.prompts):
            group, msgs = qs_all[c * (a.history + 1) : (c + 1) * (a.history + 1)], []
            for q in group[:-1]:
                msgs.append({"role": "user", "content": q["turns"][0]})
                msgs.append(
                    {"role": "assistant", "content": llm.generate(msgs, drafter=None, max_new_tokens=a.max_new).text}
                )
            convs.append([*msgs, {"role": "user", "content": group[-1]["turns"][0]}])
    elif a.turn == 1:
        convs = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
    else:
        convs = [second_turn(llm, q, a.max_new)[1] for q in qs]
    lens = [len(llm.encode_prompt(c)) for c in convs]
    print(f"{len(convs)} conversations, prompt tokens {min(lens)}-{max(lens)} (mean {sum(lens) / len(lens):.0f})")
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(a.rounds):
        sec = dict.fromkeys(names, 0.0)
        toks = dict.fromkeys(names, 0)
        for conv in convs:
            ref = None
            for n in names:
                r = llm.generate(conv, drafter=fresh_copy(drafters[n]), max_new_tokens=a.max_new)
                ref = ref if ref is not None else list(r.token_ids)
                if list(r.token_ids) != ref:
                    raise SystemExit(f"{n}: output differs from {names[0]}'s")
                sec[n] += decode_s(r)
                toks[n] += len(r.token_ids)
        ms = {n: 1e3 * sec[n] / toks[n] for n in names}
        base = ms.get("hybrid")
        line = ", ".join(f"{n} {ms[n]:.3f}" + (f" ({base / ms[n]:.3f}x hybrid)" if base else "") for n in names)
        print(f"round {rnd + 1}: ms/token {line}", flush=True)
        for n in names:
            if base:
                ratios[n].append(base / ms[n])
    if a.rounds > 1 and "hybrid" in names:
        print("median x hybrid:", {n: round(statistics.median(v), 3) for n, v in ratios.items()})


if __name__ == "__main__":
    main()
