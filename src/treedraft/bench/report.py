"""Summaries computed from the records, the Markdown report, plots, and the machine a run ran on."""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from .harness import BUSY_SUFFIX, BenchResult, Record

ALL_CATEGORIES = "all"
# CPU features that decide which kernels run (bf16/int8 matmuls, AMX tiles); reported when present
SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_info(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU model and which of :data:`SPEED_FLAGS` it has, from /proc/cpuinfo (``cpuinfo``: its text).

    ``cpu_flags`` is the present flags separated by spaces, "none" when the CPU has none of them, and
    "unknown" where no flags line can be read (e.g. macOS); ``cpu`` falls back to :mod:`platform`.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    model: str | None = None
    flags: set[str] | None = None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:  # x86, arm
            flags = set(value.split())
    have = [f for f in SPEED_FLAGS if flags is not None and f in flags]
    return {
        "cpu": model or platform.processor() or platform.machine() or "unknown",
        "cpu_flags": "unknown" if flags is None else " ".join(have) or "none",
    }


# ---------------------------------------------------------------------------------------------
# metrics (all computed from the records)


def throughput(records: Iterable[Record]) -> float:
    """sum(new_tokens) / sum(wall_s)."""
    rs = list(records)
    wall = sum(r.wall_s for r in rs)
    return sum(r.new_tokens for r in rs) / wall if wall > 0 else 0.0


def acceptance_per_depth(records: Iterable[Record]) -> list[float]:
    """Pooled P(accepted >= d | tree depth >= d) for d = 1..max depth over all steps of the records."""
    from ..engine import acceptance_per_depth as pooled

    return pooled((d, a - 1) for r in records if r.accepted_lengths for d, a in zip(r.tree_depths, r.accepted_lengths))


def _group_summary(rs: list[Record], base_tps: dict[str, float]) -> dict:
    tps = throughput(rs)
    acc = [a for r in rs if r.accepted_lengths for a in r.accepted_lengths]
    wall = sum(r.wall_s for r in rs)
    timed = [r for r in rs if r.t_verify is not None]
    split = None
    if timed and len(timed) == len(rs) and wall > 0:
        draft = sum(r.t_draft for r in rs)
        verify = sum(r.t_verify for r in rs)
        split = {
            "draft": draft / wall,
            "verify": verify / wall,
            "rest": 1 - (draft + verify) / wall,
            "prefill_s": sum(r.t_prefill or 0.0 for r in rs),
            "accept_s": sum(r.t_rest for r in rs),
        }
    compared = [r for r in rs if r.equal_to_reference is not None]
    return {
        "prompts": len(rs),
        "new_tokens": sum(r.new_tokens for r in rs),
        "wall_s": wall,
        "tokens_per_s": tps,
        "speedup": {b: (tps / t if t > 0 else None) for b, t in base_tps.items()},
        "mean_accepted_length": sum(acc) / len(acc) if acc else None,
        "steps": len(acc) if acc else None,
        "acceptance_per_depth": acceptance_per_depth(rs) if acc else None,
        "time_split": split,
        "equal": sum(bool(r.equal_to_reference) for r in compared) if compared else None,
        "compared": len(compared) if compared else None,
    }


def summarize(result: BenchResult) -> dict:
    """Per method, overall and per category: tokens/s, speedups, acceptance, time split, equality."""
    cats = sorted({r.category for r in result.records})
    out: dict[str, dict] = {}
    for cat in [ALL_CATEGORIES, *cats]:
        rs = [r for r in result.records if cat == ALL_CATEGORIES or r.category == cat]
        base_tps = {b: throughput(r for r in rs if r.method == b) for b in result.baselines}
        out[cat] = {
            m: _group_summary([r for r in rs if r.method == m], base_tps)
            for m in result.methods
            if any(r.method == m for r in rs)
        }
    return out


def busy_core_ratios(result: BenchResult) -> dict[str, dict]:
    """Per method run with ``--busy-core``: per-prompt wall(busy) / wall(quiet); median, max, worst prompt."""
    out: dict[str, dict] = {}
    for m in result.methods:
        if not m.endswith(BUSY_SUFFIX):
            continue
        base = m.removesuffix(BUSY_SUFFIX)
        quiet = {r.prompt_id: r.wall_s for r in result.records if r.method == base}
        ratios = sorted(
            (r.wall_s / quiet[r.prompt_id], r.prompt_id)
            for r in result.records
            if r.method == m and quiet.get(r.prompt_id, 0) > 0
        )
        if ratios:
            out[base] = {
                "median": statistics.median(x for x, _ in ratios),  # (the upper middle one for an even count)
                "max": ratios[-1][0],
                "worst_prompt": ratios[-1][1],
                "prompts": len(ratios),
            }
    return out


def mismatches(result: BenchResult, decode: Callable[[list[int]], str] | None = None, context: int = 6) -> list[dict]:
    """Every record whose output differs from the reference's, with the tokens around the first difference."""
    ref = {r.prompt_id: r for r in result.records if r.method == result.reference}
    out = []
    for r in result.records:
        if r.equal_to_reference is False:
            i = r.first_mismatch
            lo = max(0, i - context)
            exp, got = ref[r.prompt_id].token_ids[lo : i + context], r.token_ids[lo : i + context]
            m = {
                "method": r.method,
                "prompt_id": r.prompt_id,
                "category": r.category,
                "position": i,
                "kind": r.mismatch,
                "reference_length": len(ref[r.prompt_id].token_ids),
                "method_length": len(r.token_ids),
                "reference_tokens": exp,
                "method_tokens": got,
            }
            if decode is not None:
                m["reference_text"], m["method_text"] = decode(exp), decode(got)
            out.append(m)
    return out


# ---------------------------------------------------------------------------------------------
# report


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown_report(result: BenchResult, summary: dict, mism: list[dict]) -> str:
    """The Markdown report: overall table, per-category speedups, mismatches, skipped methods."""
    cfg = result.config
    lines = ["# treedraft bench", ""]
    if cfg:
        for k in (
            "command",
            "model",
            "dataset",
            "prompts",
            "max_new_tokens",
            "decoding",
            "device",
            "dtype",
            "weights",
            "draft_model",
            "kv_dtype",
            "attn_scores",
            "torch_threads",
            "cpu",
            "cpu_flags",
            "kernels",
            "llama_cpp",
            "gpu",
            "date",
        ):
            if k in cfg:
                lines.append(f"- {k}: `{cfg[k]}`")
        lines.append("")
    lines += [
        "tokens/s = total new tokens / total wall time (prefill included) per method; speedup = ratio of "
        "tokens/s over the same prompts; mean accepted = tokens per verify step incl. the bonus token; "
        + (
            f"equality is against `{result.reference}`: same tokens and length (a shorter output must end at "
            "EOS where the other has that EOS)."
            if result.reference is not None
            else "outputs are not compared (no reference method, e.g. plain, in the run)."
        ),
        "",
    ]
    others = [m for m in result.methods if m in ("hf", "hf-pld", "llama.cpp", "llama.cpp-pld")]
    if others:  # a baseline on other weights or arithmetic: its tokens may differ, its speed is not like for like
        lines += [
            f"{', '.join(f'`{m}`' for m in others)}: other weights or arithmetic than treedraft's methods "
            f"(transformers runs the file dequantized to {cfg.get('dtype', 'float32')}, "
            "llama.cpp its own quantized kernels; treedraft runs "
            f"`{cfg.get('weights', '?')}` weights), so their outputs may differ from "
            + (f"`{result.reference}`'s" if result.reference is not None else "treedraft's")
            + " without a bug, and their speed ratios compare different weights.",
            "",
        ]
    if cfg.get("suffix_store"):  # one store on disk for every method: runs learn from the runs before them
        lines += [
            f"--suffix-store `{cfg['suffix_store']}`: every suffix-drafting method reads and records one store on "
            "disk, so a run drafts from the outputs of the runs before it (other methods' answers to the same prompt "
            "included): a warmed-store measurement, not a cold one.",
            "",
        ]
    base = result.baselines
    head = (
        ["method", "tok/s"]
        + [f"× vs {b}" for b in base]
        + ["mean accepted", "accept. d1..d5", "draft / verify / rest", f"= {result.reference or 'reference'}"]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in summary[ALL_CATEGORIES].items():
        apd = s["acceptance_per_depth"]
        split = s["time_split"]
        row = [f"`{m}`", f"{s['tokens_per_s']:.1f}"]
        row += [_fmt(s["speedup"].get(b), ".2f", "×") for b in base]
        row += [
            _fmt(s["mean_accepted_length"]),
            " ".join(f"{a:.2f}" for a in apd[:5]) if apd else "–",
            (f"{split['draft']:.0%} / {split['verify']:.0%} / {split['rest']:.0%}" if split else "–"),
            f"{s['equal']}/{s['compared']}" if s["compared"] else "–",
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    cats = [c for c in summary if c != ALL_CATEGORIES]
    for b in base:
        lines += [f"## Speedup vs `{b}` per category", ""]
        head = ["category"] + [f"`{m}`" for m in result.methods]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in [*cats, ALL_CATEGORIES]:
            row = [c] + [_fmt(summary[c].get(m, {}).get("speedup", {}).get(b), ".2f", "×") for m in result.methods]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    busy = busy_core_ratios(result)
    if busy:
        lines += [
            "## One core busy",
            "",
            "Each run repeated right after while a spinning process keeps one core busy; "
            "ratio = wall time busy / quiet, per prompt. "
            + (
                "Every run drafted with a fresh drafter (nothing learned from earlier runs)."
                if result.config.get("fresh_drafter_state")
                else "Runs shared their drafters: a busy repeat may draft from its quiet run's output "
                "(a suffix index), which flatters its ratio (--fresh-drafter-state)."
            ),
            "",
            "| method | median | max | worst prompt | prompts |",
            "|---|---|---|---|---|",
        ]
        for m, b in busy.items():
            lines.append(f"| `{m}` | {b['median']:.2f}x | {b['max']:.2f}x | {b['worst_prompt']} | {b['prompts']} |")
        lines.append("")
    lines += ["## Output mismatches", ""]
    checked = result.greedy or result.seeded
    if result.reference is None or not checked:
        why = (
            "unseeded sampling"
            if not checked
            else "no reference method in the run"
            if result.greedy
            else "sampled: only treedraft's own methods share the seeded draws; run `plain` beside them"
        )
        lines.append(f"not checked ({why})")
    elif not mism:
        kind = "greedy" if result.greedy else "seeded sampled"
        lines.append(f"none: every method's {kind} output equals `{result.reference}`.")
    else:
        lines += [
            "| method | prompt | category | first diff at | kind | length ref / method | reference | method |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for x in mism:
            ref = x.get("reference_text", x["reference_tokens"])
            got = x.get("method_text", x["method_tokens"])
            lines.append(
                f"| `{x['method']}` | {x['prompt_id']} | {x['category']} | {x['position']} | {x['kind']} | "
                f"{x['reference_length']} / {x['method_length']} | "
                f"{json.dumps(ref, ensure_ascii=False)} | {json.dumps(got, ensure_ascii=False)} |"
            )
    lines.append("")
    if result.skipped:
        lines += ["## Skipped methods", ""]
        lines += [f"- `{m}`: {why}" for m, why in result.skipped.items()]
        lines.append("")
    return "\n".join(lines)


def plot_speedup(summary: dict, result: BenchResult, path: Path) -> None:
    """Grouped bars: speedup of each method per category, one panel per baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c in summary if c != ALL_CATEGORIES] + [ALL_CATEGORIES]
    base = result.baselines or [None]
    fig, axes = plt.subplots(len(base), 1, figsize=(max(6, 1.2 * len(cats) + 2), 3.2 * len(base)), squeeze=False)
    width = 0.8 / max(1, len(result.methods))
    for ax, b in zip(axes[:, 0], base):
        for j, m in enumerate(result.methods):
            ys = [
                (summary[c].get(m, {}).get("speedup", {}).get(b) or 0.0)
                if b
                else summary[c].get(m, {}).get("tokens_per_s", 0.0)
                for c in cats
            ]
            ax.bar([i + (j - (len(result.methods) - 1) / 2) * width for i in range(len(cats))], ys, width, label=m)
        if b:
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(cats)), cats, rotation=20)
        ax.set_ylabel(f"speedup vs {b}" if b else "tokens/s")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if labels:  # (no method left: no legend; matplotlib refused ncol 0)
        fig.legend(handles, labels, loc="upper center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accepted_hist(result: BenchResult, path: Path) -> None:
    """Histogram of tokens committed per verify step (bonus included), per method that drafted tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = {
        m: [a for r in result.records if r.method == m and r.accepted_lengths for a in r.accepted_lengths]
        for m in result.methods
    }
    drafted = {r.method for r in result.records if r.tree_sizes and max(r.tree_sizes) > 1}
    per = {m: v for m, v in per.items() if v and m in drafted}  # plain decoding is all 1s: left out
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if per:
        top = max(max(v) for v in per.values())
        width = 0.8 / len(per)
        for j, (m, v) in enumerate(per.items()):
            xs = list(range(1, top + 1))
            ys = [sum(a == x for a in v) / len(v) for x in xs]
            ax.bar(
                [x + (j - (len(per) - 1) / 2) * width for x in xs], ys, width, label=f"{m} (mean {sum(v) / len(v):.2f})"
            )
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize=8)
    _finish_drafting_plot(
        fig, ax, path, bool(per), "tokens committed per verify step (bonus included)", "fraction of steps"
    )


def _finish_drafting_plot(fig, ax, path: Path, drew: bool, xlabel: str, ylabel: str) -> None:
    """Label, save and close a per-drafting-method plot (a note when no method drafted)."""
    import matplotlib.pyplot as plt

    if not drew:
        ax.text(0.5, 0.5, "no method drafted any tokens", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance_per_depth(summary: dict, path: Path, max_depth: int = 12) -> dict[str, list[float]]:
    """Acceptance at each tree depth (P(accepted >= d | the tree reached depth d), all prompts pooled), one line
    per method that drafted: where a drafter's guesses stop being accepted. Returns the plotted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = {m: (s["acceptance_per_depth"] or [])[:max_depth] for m, s in summary[ALL_CATEGORIES].items()}
    per = {m: v for m, v in per.items() if v}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if per:
        for m, v in per.items():
            ax.plot(range(1, len(v) + 1), v, marker="o", label=m)
        ax.set_xticks(range(1, max(len(v) for v in per.values()) + 1))
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    _finish_drafting_plot(fig, ax, path, bool(per), "tree depth d", "P(accepted >= d | tree reached d)")
    return per


def write_report(
    result: BenchResult, out_dir: str | Path, decode: Callable[[list[int]], str] | None = None
) -> dict[str, Path]:
    """Write records.json, report.md, speedup_by_category.png, accepted_length_hist.png and
    acceptance_per_depth.png into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    mism = mismatches(result, decode)
    paths = {
        "json": out / "records.json",
        "markdown": out / "report.md",
        "speedup_png": out / "speedup_by_category.png",
        "hist_png": out / "accepted_length_hist.png",
        "depth_png": out / "acceptance_per_depth.png",
    }
    doc = {
        "config": result.config,
        "methods": result.methods,
        "skipped": result.skipped,
        "reference": result.reference,
        "baselines": result.baselines,
        "greedy": result.greedy,
        "seeded": result.seeded,
        "summary": summary,
        "busy_core": busy_core_ratios(result),
        "mismatches": mism,
        "records": [asdict(r) | {"mean_accepted_length": r.mean_accepted_length} for r in result.records],
    }
    paths["json"].write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths["markdown"].write_text(markdown_report(result, summary, mism), encoding="utf-8")
    plot_speedup(summary, result, paths["speedup_png"])
    plot_accepted_hist(result, paths["hist_png"])
    plot_acceptance_per_depth(summary, paths["depth_png"])
    return paths
