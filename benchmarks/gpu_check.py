"""The GPU check (issue 11), one short prepared run: parity, greedy equality, plain vs default tokens/s.

1. **Parity**: the own runtime and transformers on the same GGUF weights (both fp32, on ``--device``): logits of
   one chat prompt, max |difference| and next-token (argmax) agreement at every position.
2. **Greedy equality and speed**: ``treedraft bench`` on ``--prompts`` MT-Bench first turns (round-robin over the
   categories) x ``--max-new`` tokens, greedy, methods ``--methods`` side by side (default: plain, the default
   drafter, medusa, eagle, transformers ``generate``): every method's output against treedraft plain's, tok/s.
3. A summary (``gpu_check.md`` in ``--out``) with the machine, each check's result and the bench's table.

Runs on any device (``--device cpu`` here exercises the same code; CI runs a tiny version); on a CUDA machine
through ``benchmarks/gpu_check.sh`` (which also assembles the model file when it had to travel in parts).

    python benchmarks/gpu_check.py [--device cuda] [--prompts 8] [--max-new 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARITY_PROMPT = "Explain in three sentences why the sky is blue, then give one everyday example."
DEFAULT_METHODS = "plain,hybrid-suffix,medusa,eagle,hf"  # hybrid-suffix: the default drafter
# the own runtime and transformers compute in different orders: fp32 rounding differs in the last bits
PARITY_MAX_ABS = 1e-2
PARITY_MIN_ARGMAX = 0.98


def machine_line(device: str) -> str:
    """What ran the check: the accelerator (or CPU), torch and CUDA versions."""
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        dev = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        cuda = f", CUDA {torch.version.cuda}"
    else:
        from treedraft.bench.report import machine_info

        dev, cuda = machine_info().get("cpu", platform.processor() or "cpu"), ""
    return f"{dev}; torch {torch.__version__}{cuda}; Python {platform.python_version()}"


@torch.inference_mode()
def parity(model: str, device: str) -> dict:
    """Own runtime vs transformers, fp32 on ``device``: logits of one prompt at every position."""
    import treedraft
    from treedraft.bench import load_hf_baseline
    from treedraft.models.registry import resolve

    llm = treedraft.load(model, drafter=None, device=device, dtype="fp32", runtime="own", weights="fp32")
    ids = llm.encode_prompt([{"role": "user", "content": PARITY_PROMPT}])
    t = torch.tensor([ids], device=llm.engine.model.device)
    m = llm.engine.model
    cache = m.new_cache(len(ids) + 8)
    own = m.forward(t, torch.arange(len(ids), device=t.device), cache, 0)[0].float().reshape(len(ids), -1)
    hf = load_hf_baseline(resolve(model), torch.float32, device)
    ref = hf(t).logits.float().reshape(len(ids), -1)
    diff = (own - ref).abs().max().item()
    agree = (own.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {
        "positions": len(ids),
        "max_abs_diff": diff,
        "logit_scale": ref.abs().max().item(),
        "argmax_agreement": agree,
        "ok": diff <= PARITY_MAX_ABS and agree >= PARITY_MIN_ARGMAX,
    }


def bench(model: str, device: str, prompts: int, max_new: int, methods: str, out: Path, dataset: str | None) -> dict:
    """``treedraft bench`` side by side (greedy, fp32 on ``device``); returns its records.json."""
    from treedraft.cli import main as cli_main

    args = ["bench", "--model", model, "--device", device, "--dtype", "fp32", "--methods", methods]
    args += ["--dataset", dataset] if dataset else []
    args += ["--num-prompts", str(prompts), "--max-new-tokens", str(max_new), "--out", str(out), "--no-progress"]
    if device == "cpu":
        args += ["--weights", "fp32"]  # the same weights on every device (the GPU path is dense fp32 too)
    rc = cli_main(args)
    if rc:
        raise SystemExit(f"treedraft bench failed (exit {rc})")
    return json.loads((out / "records.json").read_text(encoding="utf-8"))


def summary(machine: str, par: dict, doc: dict, bench_md: str, seconds: float) -> tuple[str, bool]:
    """The check's report and whether every check passed (parity, each method's output = plain's)."""
    lines = ["# GPU check (benchmarks/gpu_check.py)", "", f"- machine: {machine}", f"- wall time: {seconds:.0f} s", ""]
    lines.append(
        f"- parity, own runtime vs transformers (fp32, {par['positions']} positions): max |logit diff| "
        f"{par['max_abs_diff']:.2e} (logits up to {par['logit_scale']:.1f}), next-token agreement "
        f"{par['argmax_agreement']:.3f}: **{'ok' if par['ok'] else 'FAILED'}**"
    )
    ok = bool(par["ok"])
    for name in doc["methods"]:
        rs = [r for r in doc["records"] if r["method"] == name]
        if name in ("plain", "hf", "hf-pld") or not rs:
            continue  # plain is the reference; transformers' fp32 order differs from ours (reported, not required)
        equal = sum(r["equal_to_reference"] is True for r in rs)
        ok &= equal == len(rs)
        lines.append(
            f"- greedy output of `{name}` = treedraft plain: {equal}/{len(rs)}"
            + ("" if equal == len(rs) else " **(FAILED)**")
        )
    lines += ["", "## Bench", "", bench_md]
    return "\n".join(lines) + "\n", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument(
        "--dataset", default=None, help="MT-Bench questions file (default: the bench's, ../shared/data beside the repo)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu-check"))
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from treedraft.models.registry import resolve

    machine = f"{machine_line(a.device)}; model {resolve(a.model)}"
    print("machine:", machine, flush=True)
    par = parity(a.model, a.device)
    print("parity:", par, flush=True)
    doc = bench(a.model, a.device, a.prompts, a.max_new, a.methods, out / "bench", a.dataset)
    md = (out / "bench" / "report.md").read_text(encoding="utf-8")
    text, ok = summary(machine, par, doc, md, time.perf_counter() - t0)
    (out / "gpu_check.md").write_text(text, encoding="utf-8")
    (out / "parity.json").write_text(json.dumps(par, indent=1) + "\n", encoding="utf-8")
    print(text)
    print("GPU CHECK:", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
