"""Per-step time inside vs outside the fused native forward: plain decoding and the default drafter side by side.

A decode step is one native ``FusedDecoder.forward`` call plus everything around it in Python: drafting,
tree mask / positions, packing the call, acceptance, KV compaction, sampling, detokenization and the
scheduler's bookkeeping. The native call is timed by wrapping the model's decoder (``fused._state``), the
step by the engine's own stats, so "outside" = step - native. Drafters are interleaved per prompt
(greedy, EOS ignored, through the text layer as the CLI/API run it). Each prompt runs once per drafter
(the suffix member records every finished output, so a repeated prompt would be drafted from its own
earlier answer); which drafter goes first alternates from prompt to prompt.

    python benchmarks/step_overhead.py [--weights int4] [--prompts 6] [--tokens 128]
        [--choices machine|default|'[[0],[1],[0,0]]'] [--profile]

``--choices``: the Medusa tree of the default drafter: ``machine`` (as ``treedraft.load`` chose it on this
machine), ``default`` (medusa.DEFAULT_CHOICES, 15 draft nodes: fixed, so runs of two commits compare the
same work) or a JSON list. ``--profile``: cProfile of the whole decode, top functions by own time.

Measured (branch ``step``, 2 prompts x 128 tokens, --choices default, int4, 2 threads, on the 2-core Xeon
while other jobs kept the load average at 6-10: absolute times are inflated several-fold, compare ratios;
base = commit 09e3dc9, runs interleaved base/new/base/new):

    outside the native call, ms per step     plain         hybrid-suffix (15-node Medusa tree)
    base (2 runs)                            26.5, 16.7    262.0, 183.0   (draft 234, 162)
    new  (2 runs)                             2.1,  2.6     21.3,  17.0   (draft 16.6, 13.9)
    share of the step outside                 20.8/20.5% -> 2.5/4.5%      50.7/42.1% -> 7.1/9.4%
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import treedraft
from treedraft.engine import GenerationConfig, GenerationStats
from treedraft.models import fused

DATA = Path("/work/shared/data/mt_bench_questions.jsonl")


class TimedDecoder:
    """Delegates to a native FusedDecoder and adds up the wall time of its ``forward`` calls."""

    def __init__(self, dec: object) -> None:
        self.dec, self.seconds, self.calls = dec, 0.0, 0

    def forward(self, *args: object) -> object:
        """The native forward, timed."""
        t = time.perf_counter()
        out = self.dec.forward(*args)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


def install_timer(model: torch.nn.Module) -> TimedDecoder:
    """Wrap the model's native decoder (built now if needed) so every decode forward is timed."""
    st = fused._state(model)
    if st.decoder is None:
        sys.exit(f"no fused decoder for this model: {st.reason}")
    if not isinstance(st.decoder, TimedDecoder):
        st.decoder = TimedDecoder(st.decoder)
    return st.decoder


@dataclass
class Tally:
    """Sums over the generations of one drafter."""

    tokens: int = 0
    steps: int = 0
    decode: float = 0.0  # s, first token to last commit
    native: float = 0.0  # s in FusedDecoder.forward during decoding
    calls: int = 0
    draft: float = 0.0  # s in propose (+ tree checks, mask, positions)
    verify: float = 0.0  # s in the scheduler's forward (native call + its Python glue)
    tree: int = 0  # nodes verified
    per_gen: list[float] = field(default_factory=list)  # outside ms per step, per generation


def run_one(llm: object, ids: list[int], cfg: GenerationConfig, drafter: object, timer: TimedDecoder) -> tuple:
    """One generation: (token ids, stats, native seconds, native calls of its decode steps)."""
    timer.seconds, timer.calls = 0.0, 0
    out = llm.text.generate(ids, cfg, drafter)
    return out.token_ids, out.stats, timer.seconds, timer.calls


def add(t: Tally, stats: GenerationStats, native: float, calls: int) -> None:
    """Fold one generation's stats into ``t``."""
    n = len(stats.steps)
    t.tokens += stats.new_tokens
    t.steps += n
    t.decode += stats.t_decode
    t.native += native
    t.calls += calls
    t.draft += sum(s.t_draft for s in stats.steps)
    t.verify += sum(s.t_verify for s in stats.steps)
    t.tree += sum(s.tree_size for s in stats.steps)
    t.per_gen.append(1000 * (stats.t_decode - native) / max(1, n))


def report(name: str, t: Tally) -> dict[str, float]:
    """Per-step and per-token milliseconds of one drafter."""
    s = max(1, t.steps)
    out = {
        "tok/s": t.tokens / t.decode,
        "tok/step": t.tokens / s,
        "nodes/step": t.tree / s,
        "step ms": 1000 * t.decode / s,
        "native ms": 1000 * t.native / s,
        "outside ms": 1000 * (t.decode - t.native) / s,
        "  draft ms": 1000 * t.draft / s,
        "  call glue ms": 1000 * (t.verify - t.native) / s,
        "  rest ms": 1000 * (t.decode - t.verify - t.draft) / s,
        "outside %": 100 * (t.decode - t.native) / t.decode,
        "outside ms/token": 1000 * (t.decode - t.native) / max(1, t.tokens),
        "outside med/gen": statistics.median(t.per_gen),
    }
    if t.calls != t.steps:
        print(f"note: {name}: {t.calls} native calls for {t.steps} steps", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--prompts", type=int, default=6, help="MT-Bench first turns")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--choices", default="default", help="machine, default or a JSON list of Medusa choices")
    ap.add_argument("--profile", action="store_true", help="cProfile the decodes; top functions by own time")
    args = ap.parse_args()

    llm = treedraft.load(args.model, weights=args.weights)
    default = llm.engine.drafter
    if args.choices != "machine":
        from treedraft.drafters.medusa import DEFAULT_CHOICES, MedusaDrafter

        choices = DEFAULT_CHOICES if args.choices == "default" else tuple(map(tuple, json.loads(args.choices)))
        for i, d in enumerate(getattr(default, "drafters", [])):
            if isinstance(d, MedusaDrafter):
                default.drafters[i] = MedusaDrafter(d.heads, choices)
    medusa = [d for d in getattr(default, "drafters", []) if hasattr(d, "choices")]
    timer = install_timer(llm.model)
    lines = [json.loads(x)["turns"][0] for x in DATA.read_text().splitlines()[: args.prompts + 1]]
    warm, *prompts = [llm.encode_prompt(q) for q in lines]
    cfg = GenerationConfig(max_new_tokens=args.tokens, ignore_eos=True)
    modes = {"plain": None, getattr(default, "name", "default"): default}
    print(
        f"# {args.model} {args.weights}, torch threads {torch.get_num_threads()}, {args.prompts} MT-Bench prompts x "
        f"{args.tokens} tokens, greedy; Medusa tree: "
        f"{len(medusa[0].choices) if medusa else '-'} draft nodes ({args.choices})"
    )
    for d in modes.values():  # warm-up: kernels, caches, allocator
        run_one(llm, warm, GenerationConfig(max_new_tokens=16, ignore_eos=True), d, timer)
    tallies = {m: Tally() for m in modes}
    outputs: dict[str, list[list[int]]] = {m: [] for m in modes}
    prof = cProfile.Profile() if args.profile else None
    for i, ids in enumerate(prompts):
        for m, d in list(modes.items())[:: 1 if i % 2 == 0 else -1]:
            if prof:
                prof.enable()
            toks, stats, native, calls = run_one(llm, ids, cfg, d, timer)
            if prof:
                prof.disable()
            add(tallies[m], stats, native, calls)
            outputs[m].append(toks)
    rows = {m: report(m, t) for m, t in tallies.items()}
    names = list(rows)
    print(f"{'per step':<20}" + "".join(f"{n:>16}" for n in names) + f"{'ratio':>10}")
    for key in rows[names[0]]:
        vals = [rows[n][key] for n in names]
        ratio = vals[1] / vals[0] if len(vals) == 2 and vals[0] else float("nan")
        print(f"{key:<20}" + "".join(f"{v:>16.3f}" for v in vals) + f"{ratio:>10.2f}")
    same = sum(a == b for a, b in zip(outputs[names[0]], outputs[names[-1]]))
    print(f"greedy outputs equal ({names[-1]} vs plain): {same}/{len(prompts)}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
