"""Repeated work (issue 13): MT-Bench second turns, first turns again with a warmed index, and sampled.

Side by side in one process, every method back to back on each prompt (load from other processes
hits them alike): plain, prompt-lookup, hybrid (Medusa heads + prompt lookup, the default before the
suffix drafter) and hybrid-suffix (the default: Medusa heads + the suffix drafter over this request and
earlier outputs, its trees sized by this machine's verify cost; one tree).
Per prompt, in order (prompt-major, so a run with more prompts resumes a smaller one's records):

1. ``turn1-cold``: the first turn with a cold index (hybrid-suffix gets a fresh, empty store for every
   prompt; hybrid and hybrid-suffix are run ``--cold-repeats`` times each, interleaved, to show the noise).
   Plain's answer goes into the warm store (as a server would have recorded it).
2. ``turn2``: the second turn (``turns[1]``), with the model's own first answer (plain's, from 1.) in
   the chat context.
3. ``turn1-repeat``: the first turn again, greedy, with the warm store.
4. ``turn1-sampled``: the first turn again, temperature 0.7 and a new seed per prompt.

The warm store holds every request recorded before, in run order: the first answers of this and the
earlier prompts, and hybrid-suffix's own earlier outputs.

Greedy passes check every output against plain's. hybrid-suffix records its own finished requests into
the warm store (the engine's ``finish``), as it would in a server.

Resumable: every finished (pass, prompt, method) is appended to ``OUT/records.jsonl``; a rerun with the
same settings skips those and rebuilds the warm store from them, so the full issue-13 run is one command:

    PYTHONPATH=src python benchmarks/suffix_repeated.py --prompts 80 --max-new 256 \
        --out benchmarks/results/suffix_repeated-80x256

``OUT/report.md`` is rewritten after every prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import treedraft
from treedraft.drafters import registry
from treedraft.drafters.hybrid import fresh_copy
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_store import SuffixStore

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mt_bench_questions.jsonl"
METHODS = ("plain", "prompt-lookup", "hybrid", "hybrid-suffix")
PASSES = ("turn1-cold", "turn2", "turn1-repeat", "turn1-sampled")


def suffix_member(drafter: object) -> SuffixDrafter:
    """The suffix drafter inside a hybrid."""
    return next(d for d in drafter.drafters if isinstance(d, SuffixDrafter))  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--weights", default="auto", help="treedraft.load weights (fp32, int8, int4, auto)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--cold-repeats", type=int, default=2, help="runs of hybrid and hybrid-suffix in pass 1")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1234, help="sampled pass: prompt i uses seed + i")
    ap.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated subset of {PASSES}")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report-only", action="store_true", help="rewrite OUT/report.md from OUT/records.jsonl")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,..",
        help="also run hybrid-suffix with its suffix member's fields changed (e.g. 'sfx6:priced=0,follow=0'), "
        "as method hybrid-suffix-NAME with its own warm store, filled like hybrid-suffix's",
    )
    a = ap.parse_args()
    passes = [p for p in a.passes.split(",") if p]
    bad = [p for p in passes if p not in PASSES]
    if bad:
        ap.error(f"unknown pass(es) {bad}; choose from {PASSES}")
    if "turn2" in passes and "turn1-cold" not in passes:
        ap.error("turn2 needs turn1-cold (the model's own first answers)")
    a.out.mkdir(parents=True, exist_ok=True)
    settings = {
        k: getattr(a, k) for k in ("prompts", "max_new", "weights", "threads", "cold_repeats", "temperature", "seed")
    }
    cfg_path, rec_path = a.out / "config.json", a.out / "records.jsonl"
    old = json.loads(cfg_path.read_text()) if cfg_path.exists() else None
    if old is not None and {**old, "prompts": 0} != {**settings, "prompts": 0}:  # more prompts: resumes
        sys.exit(f"{cfg_path} holds other settings {old}; use another --out")
    cfg_path.write_text(json.dumps(settings, indent=1))
    records = [json.loads(ln) for ln in rec_path.read_text().splitlines()] if rec_path.exists() else []
    if a.report_only:
        (a.out / "report.md").write_text(report(records, settings, []))
        print((a.out / "report.md").read_text())
        return
    done = {(r["pass"], r["prompt"], r["method"], r["rep"]) for r in records}

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    questions = [json.loads(ln) for ln in a.data.read_text().splitlines()][: a.prompts]
    llm = treedraft.load(drafter=None, weights=a.weights)
    opts = registry.DrafterOptions(llm.model_name, llm.heads)

    def hybrid_suffix(store: SuffixStore) -> object:
        return registry.build("hybrid-suffix", llm.model, llm.tokenizer, dataclasses.replace(opts, suffix_store=store))

    warm = SuffixStore()
    drafters = {
        "plain": None,
        "prompt-lookup": PromptLookupDrafter(),
        "hybrid": registry.build("hybrid", llm.model, llm.tokenizer, opts),
        "hybrid-suffix": hybrid_suffix(warm),
    }
    stores = {"hybrid-suffix": warm}  # each hybrid-suffix variant's warm store
    for spec in a.variant:
        name, _, fields = spec.partition(":")
        change = {k: type(getattr(SuffixDrafter, k))(int(v)) for k, v in (f.split("=") for f in fields.split(",") if f)}
        stores[f"hybrid-suffix-{name}"] = SuffixStore()
        d = hybrid_suffix(stores[f"hybrid-suffix-{name}"])
        d.drafters = [dataclasses.replace(m, **change) if isinstance(m, SuffixDrafter) else m for m in d.drafters]
        drafters[f"hybrid-suffix-{name}"] = d
    recorder = suffix_member(drafters["hybrid-suffix"])
    for r in records:  # rebuild the warm stores exactly as the finished runs left them
        for method, store in stores.items():
            if (r["pass"] == "turn1-cold" and r["method"] == "plain") or (
                r["pass"] != "turn1-cold" and r["method"] == method
            ):
                store.add(recorder.record_tokens(r["prompt_ids"], r["output_ids"]))
    for name, d in drafters.items():  # warm-up (kernels, caches); hybrid-suffix's on a throwaway store
        llm.generate("Hello", drafter=fresh_copy(d) if name in stores else d, max_new_tokens=8)

    def run(pass_: str, i: int, method: str, rep: int, messages: list[dict], drafter: object, **kw) -> dict:
        ids = llm.encode_prompt(messages)
        t = time.perf_counter()
        res = llm.text.generate(ids, llm.config(max_new_tokens=a.max_new, **kw), drafter)
        wall = time.perf_counter() - t
        st = res.stats
        rec = {
            "pass": pass_,
            "prompt": i,
            "method": method,
            "rep": rep,
            "category": questions[i].get("category", ""),
            "prompt_ids": ids,
            "output_ids": list(res.token_ids),
            "text": res.text,
            "new_tokens": st.new_tokens,
            "t_decode": st.t_decode,
            "wall": wall,
            "steps": len(st.steps),
            "committed": sum(s.accepted + 1 for s in st.steps),
            "drafted": st.drafted_tokens,
            "load": os.getloadavg()[0],
        }
        with rec_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        records.append(rec)
        done.add((pass_, i, method, rep))
        return rec

    def answer1(i: int) -> str:
        return next(
            r["text"] for r in records if r["pass"] == "turn1-cold" and r["prompt"] == i and r["method"] == "plain"
        )

    for i, q in enumerate(questions):  # prompt-major: prompt i's records depend on prompts <= i only
        for pass_ in passes:
            if pass_ == "turn2":
                messages = [
                    {"role": "user", "content": q["turns"][0]},
                    {"role": "assistant", "content": answer1(i)},
                    {"role": "user", "content": q["turns"][1]},
                ]
            else:
                messages = [{"role": "user", "content": q["turns"][0]}]
            kw = {"temperature": a.temperature, "seed": a.seed + i} if pass_ == "turn1-sampled" else {}
            reps = a.cold_repeats if pass_ == "turn1-cold" else 1
            for rep in range(reps):
                for method, d in drafters.items():
                    if rep > 0 and method != "hybrid" and method not in stores:
                        continue
                    if (pass_, i, method, rep) in done:
                        continue
                    if pass_ == "turn1-cold" and method in stores:
                        # cold: nothing indexed but this request (the same Medusa member, a fresh suffix store)
                        d = fresh_copy(d)
                    rec = run(pass_, i, method, rep, messages, d, **kw)
                    if pass_ == "turn1-cold" and method == "plain":
                        for store in stores.values():
                            store.add(recorder.record_tokens(rec["prompt_ids"], rec["output_ids"]))
            print(f"{time.strftime('%H:%M:%S')} prompt {i + 1}/{len(questions)}: {pass_} done", flush=True)
        (a.out / "report.md").write_text(report(records, settings, questions))
    (a.out / "report.md").write_text(report(records, settings, questions))
    print((a.out / "report.md").read_text())


def report(records: list[dict], settings: dict, questions: list[dict]) -> str:
    """Markdown: one table per pass, ratios within the pass (methods ran back to back per prompt)."""
    lines = [
        "# suffix drafter on repeated work (issue 13)",
        "",
        f"settings: {json.dumps(settings)}; written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "tok/s = new tokens / decode time summed over the prompts done; x plain, x hybrid: the same ratio against "
        "those methods' sums over the same prompts. per-prompt x plain: min / median / max of each prompt's own "
        "ratio (the spread is the noise of this shared machine plus real per-prompt differences). Load: 1-minute "
        "load average while running (2 cores).",
        "",
    ]
    for pass_ in PASSES:
        rs = [r for r in records if r["pass"] == pass_]
        if not rs:
            continue
        prompts = sorted({r["prompt"] for r in rs if r["method"] == "plain"})
        full = [i for i in prompts if all(any(r["prompt"] == i and r["method"] == m for r in rs) for m in METHODS)]
        lines += [
            f"## {pass_} ({len(full)} prompts with every method)",
            "",
            "| method | runs | mean accepted | tree nodes / step | tok/s | x plain | x hybrid | per-prompt x plain "
            "| output = plain |",
            "|---|---|---|---|---|---|---|---|---|",
        ]

        def tot(m: str, rep: int | None = None) -> tuple[int, float, int, int, list[dict]]:
            sel = [r for r in rs if r["method"] == m and r["prompt"] in full and (rep is None or r["rep"] == rep)]
            return (
                sum(r["new_tokens"] for r in sel),
                sum(r["t_decode"] for r in sel),
                sum(r["steps"] for r in sel),
                sum(r["committed"] for r in sel),
                sel,
            )

        if not full:
            continue
        n0, s0, *_ = tot("plain")
        base = n0 / s0
        nh, sh, *_ = tot("hybrid")
        hyb = nh / sh
        plain_tps = {r["prompt"]: r["new_tokens"] / r["t_decode"] for r in rs if r["method"] == "plain"}
        plain_out = {r["prompt"]: r["output_ids"] for r in rs if r["method"] == "plain"}
        reps = sorted({r["rep"] for r in rs})
        variants = sorted({r["method"] for r in rs} - set(METHODS))  # --variant runs
        for m in (*METHODS, *variants):
            for rep in reps if (m == "hybrid" or m.startswith("hybrid-suffix")) and len(reps) > 1 else [None]:
                n, s, steps, committed, sel = tot(m, rep)
                nodes = 1 + sum(r["drafted"] for r in sel) / max(1, steps)
                if not sel:
                    continue
                per = sorted((r["new_tokens"] / r["t_decode"]) / plain_tps[r["prompt"]] for r in sel)
                same = (
                    f"{sum(r['output_ids'] == plain_out[r['prompt']] for r in sel)}/{len(sel)}"
                    if pass_ != "turn1-sampled"
                    else "(sampled)"
                )
                label = m if rep is None else f"{m} (run {rep + 1})"
                lines.append(
                    f"| {label} | {len(sel)} | {committed / max(1, steps):.2f} | {nodes:.1f} | {n / s:.2f} | "
                    f"{n / s / base:.2f} | "
                    f"{n / s / hyb:.2f} | {per[0]:.2f} / {statistics.median(per):.2f} / {per[-1]:.2f} | {same} |"
                )
        loads = [r["load"] for r in rs]
        lines += ["", f"load average during the pass: {min(loads):.1f} .. {max(loads):.1f}", ""]
        if pass_ == "turn1-cold" and len(reps) > 1:
            lines += [cold_noise(rs, full), ""]
    return "\n".join(lines) + "\n"


def cold_noise(rs: list[dict], full: list[int]) -> str:
    """hybrid-suffix against hybrid per prompt and run, next to hybrid against itself (run 2 / run 1)."""

    def tps(m: str, i: int, rep: int) -> float | None:
        r = next((r for r in rs if r["method"] == m and r["prompt"] == i and r["rep"] == rep), None)
        return r["new_tokens"] / r["t_decode"] if r else None

    hs, hh = [], []
    for i in full:
        for rep in (0, 1):
            a, b = tps("hybrid-suffix", i, rep), tps("hybrid", i, rep)
            if a and b:
                hs.append(a / b)
        a, b = tps("hybrid", i, 1), tps("hybrid", i, 0)
        if a and b:
            hh.append(a / b)
    if not hs or not hh:
        return ""

    def q(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"median {statistics.median(xs):.3f}, min {xs[0]:.3f}, max {xs[-1]:.3f}, n={len(xs)}"

    return (
        f"Cold index, per prompt and run: hybrid-suffix tok/s / hybrid tok/s (same run): {q(hs)}. "
        f"Noise, hybrid against itself (run 2 / run 1, same prompt): {q(hh)}."
    )


if __name__ == "__main__":
    main()
