"""Could the fp32 default's int4 draft copy stream a smaller lm_head? (session 37: no)

The int4 copy of SmolLM2 that drafts for the fp32 target streams 96 MB per one-row forward, 30 MB of it the Q8_0 tied
embedding it uses as lm_head. Two ways to stream less, measured here:

- ``q4``: the lm_head re-quantized to Q4_1 (round to nearest): teacher-forced top-1 agreement with the fp32 model on
  MT-Bench answers, and the one-row forward at a ~700-token context (interleaved with the Q8_0 one);
- ``vocab``: a draft vocabulary of the K most frequent tokens (counted over the ShareGPT prompts' tokens): the share of
  the MT-Bench answers' tokens inside it (a token outside it can never be drafted).

The default drafts chains of ~8 tokens, so it needs ~0.98 agreement per token (session 37: Q8_0 0.978, Q4_1 0.896;
coverage 8k 0.899, 16k 0.945, 24k 0.966).

    python benchmarks/draft_lm_head_probe.py [--prompts 8] [--tokens 128] [--reps 60]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

import treedraft
from treedraft.models import quant_load
from treedraft.models.quant import quantize_q4_rtn
from treedraft.prompts import MT_BENCH_FILE, SHAREGPT_FILE, find_shared_data


@torch.inference_mode()
def logits(llm, ids: list[int]) -> torch.Tensor:
    """(T, V) next-token logits for every position of ``ids`` (one prefill)."""
    return llm.model.forward(torch.tensor([ids]), torch.arange(len(ids)))[0][0].float()


def one_row_timer(llm, context: int = 700):
    """A function timing one one-row forward on a ``context``-token cache of random ids."""
    m = llm.model
    cache = m.new_cache(context + 64)
    m.forward(torch.randint(100, 40000, (1, context)), torch.arange(context), cache, 0)
    tok, pos = torch.tensor([[1234]]), torch.tensor([context])

    def once() -> float:
        t = time.perf_counter()
        m.forward(tok, pos, cache, context, None, slice(-1, None))
        return time.perf_counter() - t

    return once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns (every 10th question)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    real = quant_load.gguf_weights
    lm_q4 = {"on": False}

    def weights(*args, **kw):  # the GGUF's weights, with the lm_head re-quantized to Q4_1 when asked
        out = real(*args, **kw)
        if lm_q4["on"]:
            out["lm_head"] = quant_load._fp16_scales(quantize_q4_rtn(out["lm_head"].dequantize()))
        return out

    quant_load.gguf_weights = weights
    ref = treedraft.load(drafter=None, weights="fp32")
    q8 = treedraft.load(drafter=None, weights="int4")
    lm_q4["on"] = True
    q4 = treedraft.load(drafter=None, weights="int4")
    lm_q4["on"] = False
    questions = [json.loads(line)["turns"][0] for line in open(find_shared_data(MT_BENCH_FILE))]
    agree = {"q8": [0, 0], "q4": [0, 0]}
    answers: list[int] = []
    for q in questions[::10][: a.prompts]:
        prompt = ref.encode_prompt(q)
        out = ref.generate(q, max_new_tokens=a.tokens)
        ids = list(prompt) + list(out.token_ids)
        answers += list(out.token_ids)
        want = logits(ref, ids).argmax(-1)[len(prompt) - 1 :]
        for name, llm in (("q8", q8), ("q4", q4)):
            got = logits(llm, ids).argmax(-1)[len(prompt) - 1 :]
            agree[name][0] += int((got == want).sum())
            agree[name][1] += len(want)
    print(
        "top-1 agreement with fp32:",
        {k: round(v[0] / v[1], 4) for k, v in agree.items()},
        f"({agree['q8'][1]} positions)",
    )
    t8, t4 = one_row_timer(q8), one_row_timer(q4)
    xs, ys = zip(*[(t8(), t4()) for _ in range(a.reps)])
    print(f"one-row forward at 700 tokens, median ms: Q8_0 lm_head {statistics.median(xs) * 1e3:.2f}, "
          f"Q4_1 {statistics.median(ys) * 1e3:.2f}")  # fmt: skip
    counts: collections.Counter = collections.Counter()
    for line in open(find_shared_data(SHAREGPT_FILE)):
        counts.update(ref.encode_prompt(json.loads(line)["prompt"]))
    ranked = [t for t, _ in counts.most_common()]
    for k in (4096, 8192, 16384, 24576):
        inside = set(ranked[:k])
        print(f"draft vocabulary {k}: {sum(t in inside for t in answers) / len(answers):.4f} of the answers' tokens")


if __name__ == "__main__":
    main()
