"""Load-test outputs: the markdown report, the throughput/latency plot and the files written per run."""

from __future__ import annotations

import json
from pathlib import Path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


# ----------------------------------------------------------------------------- outputs


def report_markdown(result: dict) -> str:
    """A markdown report: the run's settings and one table row per concurrency level."""
    cfg = result["config"]
    settings = (
        f"{result['time']}; {cfg['requests']} requests per level, max_tokens {cfg['max_tokens']}, "
        f"temperature {cfg['temperature']}, ignore_eos {cfg['ignore_eos']}, {cfg['num_prompts']} prompts."
    )
    header = (
        "| concurrency | tok/s | vs c=1 | req/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) | e2e p50 / p99 (s) | client CPU | errors |"
    )
    lines = [
        f"# treedraft loadtest: {result['model']} at {result['url']}",
        "",
        settings,
        "",
        header,
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((lv["tokens_per_s"] for lv in result["levels"] if lv["concurrency"] == 1), None)
    for lv in result["levels"]:
        lat = lv["latency"]
        speed = f"{lv['tokens_per_s'] / base:.2f}x" if base else "-"
        e2e = " / ".join("-" if lat[k] is None else f"{lat[k]:.2f}" for k in ("e2e_p50", "e2e_p99"))
        errs = f"{lv['errors']}/{lv['requests']}" + (
            f" ({', '.join(f'{k}: {n}' for k, n in sorted(lv['error_kinds'].items()))})" if lv["errors"] else ""
        )
        cpu = lv.get("client_cpu_s")
        client = "-" if cpu is None or not lv["wall_s"] else f"{100 * cpu / lv['wall_s']:.0f}%"
        lines.append(
            f"| {lv['concurrency']} | {lv['tokens_per_s']:.1f} | {speed} | {lv['requests_per_s']:.2f} | "
            + " | ".join(f"{_ms(lat[k + '_p50'])} / {_ms(lat[k + '_p99'])}" for k in ("ttft", "tpot", "itl"))
            + f" | {e2e} | {client} | {errs} |"
        )
    lines += [
        "",
        (
            "Throughput = completion tokens of successful requests / wall time of the level. TTFT: send to "
            "first content; TPOT: per request, (end - first content) / (tokens - 1); ITL: gaps between "
            "streamed content events. Client CPU: this load-test process's CPU time over the level's wall "
            "time (100% = one core); on the server's own machine it is taken from the server."
        ),
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """Throughput and latency against concurrency (PNG); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lv = result["levels"]
    cs = [x["concurrency"] for x in lv]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(cs, [x["tokens_per_s"] for x in lv], "o-", label="tokens/s")
    a1.set(xlabel="concurrency", ylabel="tokens/s (aggregate)", title="Throughput", xscale="log")
    a1.set_ylim(bottom=0)
    positive = False
    for key, style in (("ttft", "o-"), ("itl", "s--"), ("tpot", "^:")):
        for q, alpha in (("p50", 1.0), ("p99", 0.5)):
            ys = [x["latency"][f"{key}_{q}"] for x in lv]
            ys = [float("nan") if y is None else y * 1000 for y in ys]
            positive |= any(y > 0 for y in ys)  # NaN compares False
            a2.plot(cs, ys, style, alpha=alpha, label=f"{key.upper()} {q}")
    # log scale spans TTFT (queueing) and ITL; it needs a positive value (a level of only errors has none)
    a2.set(
        xlabel="concurrency",
        ylabel="ms (log scale)" if positive else "ms",
        title="Latency",
        xscale="log",
        yscale="log" if positive else "linear",
    )
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.minorticks_off()
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(alpha=0.3)
    fig.suptitle(f"treedraft loadtest: {result['model']}, max_tokens {result['config']['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    """loadtest.json, report.md and loadtest.png (when matplotlib is installed) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "loadtest.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["markdown"].write_text(report_markdown(result))
    png = plot(result, out / "loadtest.png")
    if png is not None:
        paths["plot"] = png
    return paths


# ----------------------------------------------------------------------------- CLI
