"""The GPU check (issue 11), one short prepared run: parity, greedy equality, plain vs default tokens/s.

1. **Parity**: the own runtime and transformers on the same GGUF weights (both fp32, on ``--device``): logits of
   one chat prompt, max |difference| and next-token (argmax) agreement at every position.
2. **Greedy equality and speed**: ``treedraft bench`` on ``--prompts`` MT-Bench first turns (round-robin over the
   categories) x ``--max-new`` tokens, greedy, methods ``--methods`` side by side (default: plain, the default
   drafter, medusa, eagle, transformers ``generate``): every method's output against treedraft plain's, tok/s.
3. **Other paths**, each with the default drafter beside plain decoding on ``--device``: seeded sampling, JSON
   Schema, penalties, logprobs, and four requests batched through the server's scheduler against each alone; on
   CUDA also bf16, the dtype a GPU user gets by default (``--no-paths`` skips them). A path that raises fails the
   check; equality is reported.
4. A summary (``gpu_check.md`` in ``--out``) with the machine, each check's result and the bench's table.

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


PATH_PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "List three primary colors.", "Say hi."]
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "rating": {"type": "integer", "minimum": 1,
                   "maximum": 5}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["title", "rating", "tags"],
}  # fmt: skip


def _failed(e: Exception) -> dict:
    """A path that raised, as the summary reports it."""
    return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


@torch.inference_mode()
def paths(model: str, device: str, tokens: int = 48, bf16: bool | None = None) -> dict:
    """The engine's other paths on ``device``, each with the default drafter beside plain decoding: seeded sampling,
    JSON Schema, penalties, logprobs, and four requests batched through the server's scheduler (2 greedy, 2
    sampled) against each alone. A path that raises fails the check; equality with plain is reported (on the CPU it
    holds by construction; a GPU's kernels may round a tree row differently from a single row)."""
    import treedraft
    from treedraft.engine import GenerationStats
    from treedraft.scheduler import Scheduler

    bf16 = device.startswith("cuda") if bf16 is None else bf16
    llm = treedraft.load(model, device=device, dtype="fp32", runtime="own", weights="fp32")
    q = [{"role": "user", "content": "Describe a lighthouse in two sentences."}]
    out: dict = {}
    cases = {
        "sampled (t 0.7, seed 3)": dict(temperature=0.7, top_p=0.95, seed=3),
        "JSON Schema": dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
        "penalties (repetition 1.2, presence 0.5)": dict(repetition_penalty=1.2, presence_penalty=0.5),
        "logprobs 2": dict(logprobs=2),
    }
    for name, kw in cases.items():
        try:
            plain = llm.generate(q, drafter=None, max_new_tokens=tokens, **kw)
            spec = llm.generate(q, max_new_tokens=tokens, **kw)
            out[name] = {"ok": True, "equal": spec.token_ids == plain.token_ids, "tokens": len(spec.token_ids),
                         "mean_accepted": round(spec.stats.mean_accepted_length, 2)}  # fmt: skip
            if "response_format" in kw and spec.finish_reason == "stop":
                json.loads(spec.text)  # a closed answer must parse
        except Exception as e:  # a crash on this device is what the check is for
            out[name] = _failed(e)
    try:
        reqs = []
        for i, text in enumerate(PATH_PROMPTS):
            kw = dict(temperature=0.8, top_p=0.9, seed=7 + i) if i % 2 else {}
            reqs.append((llm.encode_prompt([{"role": "user", "content": text}]), llm.config(tokens, **kw)))
        alone = [llm.engine.generate(p, c, llm.engine.drafter).token_ids for p, c in reqs]
        sched = Scheduler(llm.engine, 16, 64)
        got: dict = {}
        for i, (p, c) in enumerate(reqs):
            got[sched.add(p, c, "default", GenerationStats())] = i
        res: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
        while sched.active:
            for req, new in sched.step():
                if req.error is not None:
                    raise RuntimeError(f"request {got[req]}: {req.error}")
                res[got[req]] += new
            for req in [r for r in sched.active if r.done]:
                sched.remove(req)
        out["batched (4 requests, scheduler)"] = {
            "ok": all(len(res[i]) > 0 for i in res),
            "equal": sum(res[i] == alone[i] for i in res),
            "of": len(res),
        }
    except Exception as e:
        out["batched (4 requests, scheduler)"] = _failed(e)
    if bf16:  # what a GPU user gets by default (--dtype auto is bf16 on CUDA): greedy default drafter vs plain
        name = "bf16 (the CUDA default dtype), greedy, 4 prompts"
        try:
            del llm
            b16 = treedraft.load(model, device=device, dtype="bf16")
            n_eq, tok, sec = 0, {"plain": 0, "default": 0}, {"plain": 0.0, "default": 0.0}
            for text in PATH_PROMPTS:
                m = [{"role": "user", "content": text}]
                r = {
                    k: b16.generate(m, drafter=None if k == "plain" else "default", max_new_tokens=tokens) for k in tok
                }
                n_eq += r["plain"].token_ids == r["default"].token_ids
                for k, v in r.items():
                    tok[k] += v.stats.new_tokens
                    sec[k] += v.stats.t_decode
            rate = {k: tok[k] / max(sec[k], 1e-9) for k in tok}
            out[name] = {"ok": True, "equal": n_eq, "of": len(PATH_PROMPTS),
                         "speed": f"plain {rate['plain']:.1f} tok/s, default {rate['default']:.1f} tok/s"}  # fmt: skip
        except Exception as e:
            out[name] = _failed(e)
    return out


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


def summary(
    machine: str, par: dict, doc: dict, bench_md: str, seconds: float, extra: dict | None = None
) -> tuple[str, bool]:
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
    if extra:
        lines += ["", "## Other paths (default drafter beside plain; equality reported, a crash fails)", ""]
        for name, r in extra.items():
            ok &= bool(r["ok"])
            if not r["ok"]:
                lines.append(f"- {name}: **FAILED**: {r['error']}")
            elif "of" in r:
                lines.append(f"- {name}: ran; = {'plain' if 'speed' in r else 'alone'} {r['equal']}/{r['of']}"
                             + (f"; {r['speed']}" if "speed" in r else ""))  # fmt: skip
            else:
                lines.append(f"- {name}: ran; = plain: {r['equal']}; {r['tokens']} tokens, mean accepted "
                             f"{r['mean_accepted']}")  # fmt: skip
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
    ap.add_argument("--no-paths", action="store_true", help="skip the other paths (sampling, JSON, batched, ...)")
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
    extra = {} if a.no_paths else paths(a.model, a.device)
    print("paths:", extra, flush=True)
    doc = bench(a.model, a.device, a.prompts, a.max_new, a.methods, out / "bench", a.dataset)
    md = (out / "bench" / "report.md").read_text(encoding="utf-8")
    text, ok = summary(machine, par, doc, md, time.perf_counter() - t0, extra)
    (out / "gpu_check.md").write_text(text, encoding="utf-8")
    (out / "parity.json").write_text(json.dumps(par, indent=1) + "\n", encoding="utf-8")
    print(text)
    print("GPU CHECK:", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
