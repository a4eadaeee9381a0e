"""Quality of each weight format against the fp32 reference (issue 11).

For each format (fp32 = the dequantized GGUF, int4 = its own Q4 blocks through the int4 kernel, int8):
- next-token top-1 agreement with fp32 and mean KL(fp32 || format) on teacher-forced answers: a few
  MT-Bench first turns, each answered greedily by the fp32 model, then every model scores that same text;
- perplexity on a fixed English text (this file's TEXT).

    python benchmarks/quant_quality.py --prompts 4 --answer-tokens 96   # -> benchmarks/results/quant_quality.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "far faster than scribes. Within fifty years, presses were operating in more than two hundred cities "
    "across Europe. The cost of books fell sharply, and pamphlets, newspapers and scientific journals "
    "followed. Historians argue that the press accelerated the Reformation, standardized languages, and "
    "made it possible for scientists to build on each other's work instead of rediscovering it."
)


@torch.inference_mode()
def logits_of(llm, ids: list[int]) -> torch.Tensor:
    """(T, V) float32 next-token logits for every position of ``ids`` (one prefill)."""
    x = torch.tensor([ids])
    return llm.model.forward(x, torch.arange(len(ids)))[0][0].float()


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, int]:
    """(top-1 agreement, mean KL(ref || got) in nats, positions) over rows of (T, V) logits."""
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return agree, float(kl.mean()), ref.shape[0]


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1]."""
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll))


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write JSON + markdown."""
    import treedraft
    from treedraft.bench import find_default_dataset, load_prompts
    from treedraft.engine import GenerationConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns to answer and score")
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)

    ds = find_default_dataset()
    prompts = [p.text for p in load_prompts(ds)][: a.prompts] if ds else ["Explain how a printing press works."]
    t0 = time.perf_counter()
    ref = treedraft.load(a.model, drafter=None, weights="fp32")
    formats = [f for f in a.formats.split(",") if f]
    llms = {f: treedraft.load(a.model, drafter=None, weights=f) for f in formats}
    cfg = GenerationConfig(max_new_tokens=a.answer_tokens)
    seqs = []
    for p in prompts:  # teacher-forced text: the prompt plus the fp32 model's own greedy answer
        ids = ref.encode_prompt(p)
        seqs.append((ids, ids + ref.engine.generate(ids, cfg, None).token_ids))
    text_ids = ref.tokenizer.encode(TEXT)
    ref_text = logits_of(ref, text_ids)
    ref_logits = [logits_of(ref, s)[len(p) - 1 : -1] for p, s in seqs]  # rows that predict answer tokens
    rows = {
        "fp32": {
            "top1_agreement": 1.0,
            "mean_kl": 0.0,
            "perplexity": perplexity(ref_text, text_ids),
            "info": {"weights": "fp32"},
        }
    }
    for f, llm in llms.items():
        tot, agree_sum, kl_sum = 0, 0.0, 0.0
        for (p, s), r in zip(seqs, ref_logits):
            ag, kl, n = compare(r, logits_of(llm, s)[len(p) - 1 : -1])
            agree_sum, kl_sum, tot = agree_sum + ag * n, kl_sum + kl * n, tot + n
        rows[f] = {
            "top1_agreement": agree_sum / tot,
            "mean_kl": kl_sum / tot,
            "perplexity": perplexity(logits_of(llm, text_ids), text_ids),
            "info": getattr(llm.model, "weights_info", {}),
        }
    env = {
        "command": "python benchmarks/quant_quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": a.model,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "prompts": len(seqs),
        "scored_tokens": sum(len(s) - len(p) for p, s in seqs),
        "text_tokens": len(text_ids),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    res = {"environment": env, "formats": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_quality.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [
        "# Weight formats vs the fp32 reference",
        "",
        f"- command: `{env['command']}`",
        f"- model `{a.model}`, torch {env['torch']}, {env['threads']} threads, {env['platform']}",
        f"- teacher-forced: {env['prompts']} MT-Bench first turns + the fp32 model's greedy answers "
        f"({env['scored_tokens']} scored tokens); perplexity text: {env['text_tokens']} tokens",
        "",
        "| weights | top-1 agreement | mean KL (nats) | perplexity | kernels |",
        "|---|---|---|---|---|",
    ]
    for f, r in rows.items():
        k = r["info"].get("kernels", {})
        lines.append(
            f"| {f} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {r['perplexity']:.3f} | "
            f"{', '.join(f'{a}: {b}' for a, b in k.items()) or '-'} |"
        )
    md = "\n".join(lines) + "\n"
    (out / "quant_quality.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
