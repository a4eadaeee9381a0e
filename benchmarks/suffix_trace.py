"""Per-step trace of the default drafter (hybrid-suffix) on MT-Bench second turns (issue 13).

For every verify step: the suffix member's match length (request index and store), the tree each
member proposed (size, depth), the merged tree, the tokens accepted and which member's branch they
followed, what capped the suffix tree (node budget / alpha x match / depth cap / the continuation
ended), and how many tokens an uncapped chain along the longest match would have had accepted (the
tokens left on the table). Greedy, so the second turns' first answers come from plain decoding.

    PYTHONPATH=src python benchmarks/suffix_trace.py --prompts 6 --max-new 128 --weights int4 \
        --drafter hybrid-suffix --out benchmarks/results/suffix_trace-6x128

writes OUT/DRAFTER.jsonl (one row per step) and OUT/DRAFTER.md (the summary).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import treedraft
from treedraft.drafters import registry
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree, matched_depth

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mt_bench_questions.jsonl"


def depth_of(tree: TokenTree) -> int:
    """Longest root-to-leaf path, root excluded."""
    dep = [0] * len(tree)
    for i, p in enumerate(tree.parents):
        if p >= 0:
            dep[i] = dep[p] + 1
    return max(dep)


@dataclasses.dataclass
class Tracer:
    """Wraps a hybrid drafter: the same trees, plus a record per propose."""

    inner: HybridDrafter
    steps: list[dict] = dataclasses.field(default_factory=list)
    name: str = "trace"

    def propose(self, ctx: DraftContext) -> TokenTree:
        """The hybrid's tree; each member's own tree and the suffix member's match are recorded."""
        members = []
        sfx = None
        for d in self.inner.drafters:
            sc = getattr(d, "propose_scored", None)
            t, s = sc(ctx) if callable(sc) else (d.propose(ctx), None)
            members.append((getattr(d, "name", type(d).__name__), t, s))
            if isinstance(d, SuffixDrafter):
                sfx = d
        merged = self.inner.propose(ctx)
        rec = {
            "pos": len(ctx.tokens) - ctx.prompt_len,
            "budget": ctx.max_nodes,
            "members": [(n, len(t) - 1, depth_of(t), s) for n, t, s in members],
            "trees": members,
            "merged": merged,
            "merged_size": len(merged) - 1,
            "merged_depth": depth_of(merged),
        }
        if sfx is not None:
            m, nxt = sfx._local.match(ctx.tokens, sfx.max_match, sfx.min_match, sfx.max_occurrences)
            rec["m_local"] = m
            # the uncapped chain: most probable path, as deep as the index continues
            full = sfx._local.expand(nxt, m, 256, 256, 0.0, sfx.expand_occurrences) if m >= sfx.min_match else None
            chain, node = [], -1
            if full is not None:
                for i, (t, p) in enumerate(zip(full.tokens, full.parents)):
                    if p == node:
                        chain.append(t)
                        node = i
            rec["chain"] = chain
        self.steps.append(rec)
        return merged

    def finish(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Forwarded to the hybrid."""
        self.inner.finish(prompt_ids, output_ids)


def analyse(steps: list[dict], out: list[int]) -> list[dict]:
    """Fill in accepted tokens and per-member path depth from the final output."""
    rows = []
    for s in steps:
        fut = out[s["pos"] : s["pos"] + 300]  # tokens after the root (out[pos-1] is the root)
        acc = matched_depth(s["merged"], fut)
        row = {k: v for k, v in s.items() if k not in ("trees", "merged", "chain")}
        row["accepted"] = acc
        row["member_depth"] = [(n, matched_depth(t, fut)) for n, t, _ in s["trees"]]
        ch = s.get("chain") or []
        agree = 0
        for a, b in zip(ch, fut):
            if a != b:
                break
            agree += 1
        row["chain_len"], row["chain_agree"] = len(ch), agree
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafter", default="hybrid-suffix")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    qs = [json.loads(ln) for ln in a.data.read_text().splitlines()][: a.prompts]
    llm = treedraft.load(drafter=None, weights=a.weights)
    opts = registry.DrafterOptions(llm.model_name, llm.heads)
    a.out.mkdir(parents=True, exist_ok=True)
    all_rows = []
    for i, q in enumerate(qs):
        ids1 = llm.encode_prompt([{"role": "user", "content": q["turns"][0]}])
        r1 = llm.text.generate(ids1, llm.config(max_new_tokens=a.max_new), None)
        store = SuffixStore()
        tr = Tracer(registry.build(a.drafter, llm.model, llm.tokenizer, dataclasses.replace(opts, suffix_store=store)))
        tr.finish(ids1, list(r1.token_ids))  # a server would have recorded the first turn
        msgs = [
            {"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": r1.text},
            {"role": "user", "content": q["turns"][1]},
        ]
        ids2 = llm.encode_prompt(msgs)
        t = time.perf_counter()
        r2 = llm.text.generate(ids2, llm.config(max_new_tokens=a.max_new), tr)
        wall = time.perf_counter() - t
        rows = analyse(tr.steps, list(r2.token_ids))
        for r in rows:
            r["prompt"] = i
        all_rows += rows
        acc = [r["accepted"] + 1 for r in rows]
        print(
            f"prompt {i}: {len(r2.token_ids)} tokens, {len(rows)} steps, mean accepted {statistics.mean(acc):.2f}, "
            f"mean tree {statistics.mean(r['merged_size'] for r in rows):.1f}, {wall:.1f} s",
            flush=True,
        )
    with (a.out / f"{a.drafter}.jsonl").open("w") as f:
        for r in all_rows:
            f.write(json.dumps(r) + "\n")
    (a.out / f"{a.drafter}.md").write_text(summary(all_rows) + "\n")
    print(summary(all_rows))


def summary(rows: list[dict]) -> str:
    """Where tokens are left: per-step classes and totals (time estimated on the quiet Xeon int4 curve)."""
    from suffix_replay import QUIET_CURVE

    from treedraft.drafters.suffix_sizing import LatencyCurve

    curve = LatencyCurve(QUIET_CURVE)
    n = len(rows)
    acc = sum(r["accepted"] + 1 for r in rows)
    rows_verified = sum(r["merged_size"] + 1 for r in rows)
    est = sum(float(curve(r["merged_size"] + 1)) for r in rows)
    lost_cap = sum(max(0, r["chain_agree"] - r["accepted"]) for r in rows)
    no_match = sum(1 for r in rows if r.get("m_local", 0) < 2)
    out = [
        f"steps {n}, committed {acc} (mean {acc / n:.2f}), verify rows {rows_verified} ({acc / rows_verified:.2f} tok/row)",
        f"estimated x plain on the quiet curve: {acc * float(curve(1)) / est:.2f}",
        f"steps without a >=2-token match: {no_match}",
        f"tokens an uncapped longest-match chain would have added: {lost_cap}",
    ]
    by_m: dict[str, list[dict]] = {}
    for r in rows:
        m = r.get("m_local", 0)
        b = "0-1" if m < 2 else "2-3" if m < 4 else "4-7" if m < 8 else "8-15" if m < 16 else "16+"
        by_m.setdefault(b, []).append(r)
    out.append(
        "match | steps | drafts accepted (mean) | tree nodes (mean) | uncapped chain agrees (mean) | its length (mean)"
    )
    for b in ("0-1", "2-3", "4-7", "8-15", "16+"):
        rs = by_m.get(b, [])
        if rs:
            out.append(
                f"{b} | {len(rs)} | {statistics.mean(r['accepted'] for r in rs):.2f} | "
                f"{statistics.mean(r['merged_size'] for r in rs):.1f} | "
                f"{statistics.mean(r['chain_agree'] for r in rs):.2f} | {statistics.mean(r['chain_len'] for r in rs):.1f}"
            )
    return "\n".join(out)


if __name__ == "__main__":
    main()
