"""`treedraft bench`: Spec-Bench-style benchmark of decoding methods side by side.

A *method* is any callable ``method(prompt_ids) -> MethodOutput`` (or a
``(token_ids, stats)`` tuple); ``stats`` is anything shaped like
:class:`~treedraft.engine.GenerationStats` (``steps`` with ``tree_depth``,
``accepted``, ``t_draft``, ``t_verify``, ``t_rest``; ``t_prefill``) or ``None``
for methods that do not report it (transformers, llama.cpp).

The harness (:func:`run_bench`) runs every method on every prompt, interleaved
per prompt with the method order rotated from prompt to prompt so machine drift
hits all methods alike; warm-up runs are excluded. It times each call itself
(wall clock, prefill included), so all methods are measured the same way.
Everything in the summary is computed from the per-prompt records
(:func:`summarize`), which are written to JSON alongside a Markdown report and
PNG plots (:func:`write_report`).

Definitions used throughout:
- tokens/s of a group of records = sum(new_tokens) / sum(wall_s);
- speedup of method M vs baseline B = tokens/s(M) / tokens/s(B) over the same prompts;
- mean accepted length = tokens committed per verify step, bonus token included;
- acceptance at depth d = P(accepted >= d | the drafted tree reached depth d), pooled over steps;
- output equality (greedy only): the method's ids vs the reference's (treedraft plain), same tokens
  and same length; the one allowed length difference is an output that ended at an EOS token
  (the last id of the shorter one is one its own method stops at) where the other has the same
  token and ran on (ignore_eos, or a method with a different EOS set). A shorter output that did
  not end at EOS is a "truncated" mismatch, a longer one past a reference that did not end at EOS a
  "longer" one; both are listed with the differing tokens, never hidden.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .prompts import (MT_BENCH_FILE, SHARED_DATA, Prompt, PromptFileError,
                      find_shared_data, read_prompt_file)

DEFAULT_DATASET = SHARED_DATA / MT_BENCH_FILE
BASELINE_METHODS = ("hf", "hf-pld", "plain", "llama.cpp", "llama.cpp-pld")
DEFAULT_BASELINES = ("hf", "plain")
REFERENCE = "plain"
ALL_CATEGORIES = "all"

# Used only when no dataset is given and the MT-Bench file is not found next to the repo.
BUILTIN_PROMPTS = (
    ("writing", "Write a short, friendly email inviting a colleague to a team lunch next Friday."),
    ("coding", "Write a Python function that returns the n-th Fibonacci number, and explain it briefly."),
    ("math", "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps."),
    ("reasoning", "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain."),
    ("extraction", "List the countries and capitals in this text: Paris is the capital of France, "
                   "Rome of Italy, and Madrid of Spain."),
    ("stem", "Explain in simple terms why the sky is blue."),
    ("humanities", "Summarize the main causes of the French Revolution in a few sentences."),
    ("roleplay", "Pretend you are a tour guide in Rome and describe the Colosseum to a group of visitors."),
)


class BenchError(ValueError):
    """A benchmark request that cannot run (bad dataset, unknown method); the message says what to change."""


# ---------------------------------------------------------------------------------------------
# prompts


BenchPrompt = Prompt  # one benchmark prompt: the first turn of a question (id, category, text)


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a jsonl of prompts (see :mod:`treedraft.prompts` for the formats); ids must be unique."""
    if not Path(path).exists():
        raise BenchError(f"dataset {path} does not exist; pass --dataset FILE (jsonl)")
    try:
        out = read_prompt_file(path)
    except PromptFileError as e:
        raise BenchError(str(e)) from e
    seen: set[str] = set()
    for p in out:
        if p.id in seen:
            raise BenchError(f"{path}: duplicate question id {p.id!r}; ids must be unique")
        seen.add(p.id)
    return out


def select_prompts(prompts: Sequence[BenchPrompt], k: int | None) -> list[BenchPrompt]:
    """The first ``k`` prompts taken round-robin over categories (file order within each), so a
    small ``k`` still covers every category; ``None`` or ``k >= len`` keeps all, in file order."""
    if k is None or k >= len(prompts):
        return list(prompts)
    if k <= 0:
        raise BenchError(f"--num-prompts must be positive, got {k}")
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    queues = list(by_cat.values())
    out: list[BenchPrompt] = []
    i = 0
    while len(out) < k:
        q = queues[i % len(queues)]
        depth = i // len(queues)
        if depth < len(q):
            out.append(q[depth])
        i += 1
    return out


def find_default_dataset() -> Path | None:
    """``../shared/data/mt_bench_questions.jsonl`` relative to the cwd or the repo root, if present."""
    return find_shared_data(MT_BENCH_FILE)


# ---------------------------------------------------------------------------------------------
# methods


@dataclass
class MethodOutput:
    """What a method returns for one prompt."""

    token_ids: list[int]
    stats: Any = None  # GenerationStats-like, or None when the method does not report steps
    finish_reason: str = ""


Method = Callable[[list[int]], "MethodOutput | tuple[list[int], Any]"]


@dataclass
class EngineMethod:
    """treedraft's one decode loop with a given drafter (None = plain decoding)."""

    engine: Any  # treedraft.engine.Engine
    config: Any  # treedraft.engine.GenerationConfig
    drafter: Any = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids this method stops at (the engine's; none with ignore_eos)."""
        return frozenset() if getattr(self.config, "ignore_eos", False) else frozenset(self.engine.eos_token_ids)

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        """Generate with the engine; stats are the engine's own."""
        r = self.engine.generate(prompt_ids, self.config, self.drafter)
        return MethodOutput(list(r.token_ids), r.stats, r.finish_reason)


@dataclass
class HFMethod:
    """transformers ``generate`` on a causal LM, optionally with its prompt-lookup decoding."""

    model: Any  # transformers PreTrainedModel
    max_new_tokens: int
    prompt_lookup_num_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids ``generate`` stops at (generation_config, else the model config)."""
        out: set[int] = set()
        for cfg in (getattr(self.model, "generation_config", None), getattr(self.model, "config", None)):
            e = getattr(cfg, "eos_token_id", None)
            out.update(int(t) for t in ([] if e is None else [e] if isinstance(e, int) else e))
            if out:
                break
        return frozenset(out)

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        """Run ``generate`` and return only the new tokens: up to and including the EOS it stops at (if any)."""
        import torch

        x = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        kw: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, attention_mask=torch.ones_like(x))
        if self.prompt_lookup_num_tokens:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        if self.temperature > 0:
            if self.seed is not None:
                torch.manual_seed(self.seed)
            kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # 0 = off
        else:
            kw.update(do_sample=False)
        with torch.inference_mode():
            out = self.model.generate(x, **kw)
        new = out[0, x.shape[1]:].tolist()
        return MethodOutput(new, None, "length" if len(new) >= self.max_new_tokens else "stop")


@dataclass
class LlamaCppMethod:
    """llama.cpp through ``llama-cpp-python`` on the GGUF itself (quantized weights: outputs differ)."""

    llama: Any  # llama_cpp.Llama
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The id this method stops at."""
        return frozenset({int(self.llama.token_eos())})

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        """Stream tokens from ``Llama.generate`` until EOS (kept as the last token) or max_new_tokens."""
        eos = self.llama.token_eos()
        greedy = self.temperature <= 0
        if self.seed is not None:
            self.llama.set_seed(self.seed)
        out: list[int] = []
        reason = "length"
        for tok in self.llama.generate(list(prompt_ids), reset=True, temp=0.0 if greedy else self.temperature,
                                       top_k=1 if greedy else self.top_k, top_p=1.0 if greedy else self.top_p,
                                       repeat_penalty=1.0):
            out.append(int(tok))
            if tok == eos:
                reason = "stop"
                break
            if len(out) >= self.max_new_tokens:
                break
        return MethodOutput(out, None, reason)


def _as_output(result: Any) -> MethodOutput:
    if isinstance(result, MethodOutput):
        return result
    if isinstance(result, tuple) and len(result) == 2:
        return MethodOutput([int(t) for t in result[0]], result[1])
    raise TypeError(f"a method must return MethodOutput or (token_ids, stats), got {type(result).__name__}")


# ---------------------------------------------------------------------------------------------
# records


@dataclass
class Record:
    """One method on one prompt."""

    method: str
    prompt_id: str
    category: str
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    finish_reason: str
    token_ids: list[int]
    # per verify step, from the method's stats (None when the method does not report them)
    accepted_lengths: list[int] | None = None  # accepted draft tokens + 1 (bonus)
    tree_depths: list[int] | None = None
    tree_sizes: list[int] | None = None
    t_prefill: float | None = None
    t_draft: float | None = None
    t_verify: float | None = None
    t_rest: float | None = None
    # output equality vs the reference method (None: not compared, e.g. sampling or no reference)
    equal_to_reference: bool | None = None
    first_mismatch: int | None = None  # index of the first differing (or missing / extra) token
    mismatch: str | None = None  # "differs", "truncated" (shorter, no EOS) or "longer" (see compare_outputs)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens committed per verify step, bonus included."""
        if not self.accepted_lengths:
            return None
        return sum(self.accepted_lengths) / len(self.accepted_lengths)


def make_record(method: str, prompt: BenchPrompt, prompt_ids: Sequence[int], out: MethodOutput,
                wall_s: float) -> Record:
    """Build a record from a method's output and the harness's wall time."""
    ids = [int(t) for t in out.token_ids]
    r = Record(method, prompt.id, prompt.category, len(prompt_ids), len(ids), wall_s,
               len(ids) / wall_s if wall_s > 0 else 0.0, out.finish_reason, ids)
    st = out.stats
    steps = getattr(st, "steps", None) if st is not None else None
    if steps is not None:
        r.accepted_lengths = [int(s.accepted) + 1 for s in steps]
        r.tree_depths = [int(s.tree_depth) for s in steps]
        r.tree_sizes = [int(s.tree_size) for s in steps]
        r.t_draft = float(sum(s.t_draft for s in steps))
        r.t_verify = float(sum(s.t_verify for s in steps))
        r.t_rest = float(sum(s.t_rest for s in steps))
    if st is not None and getattr(st, "t_prefill", None) is not None:
        r.t_prefill = float(st.t_prefill)
    return r


def compare_outputs(reference: Sequence[int], other: Sequence[int], *, reference_eos: Iterable[int] = (),
                    other_eos: Iterable[int] = ()) -> tuple[bool, int | None, str | None]:
    """Greedy output equality: (equal, index of the first difference, kind of mismatch).

    Equal = the same tokens and the same length. Lengths may differ only where the shorter output
    ended at an EOS of its own method (its last token is in ``reference_eos`` / ``other_eos``) and
    the other has that same token there: one method stopped at an EOS the other runs past (a
    different EOS set, ignore_eos). Otherwise:
    ``"differs"`` (a different token at the index), ``"truncated"`` (``other`` is shorter and did not
    end at EOS; index = ``len(other)``) or ``"longer"`` (``other`` goes on where the reference ended
    without EOS; index = ``len(reference)``).
    """
    n = min(len(reference), len(other))
    for i in range(n):
        if reference[i] != other[i]:
            return False, i, "differs"
    if len(reference) == len(other):
        return True, None, None
    shorter, eos = (other, other_eos) if len(other) < len(reference) else (reference, reference_eos)
    if shorter and shorter[-1] in frozenset(eos):
        return True, None, None
    return False, n, "truncated" if len(other) < len(reference) else "longer"


# ---------------------------------------------------------------------------------------------
# the harness


@dataclass
class BenchResult:
    """Everything one run produced."""

    records: list[Record]
    methods: list[str]
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it did not run
    reference: str | None = REFERENCE
    baselines: list[str] = field(default_factory=list)
    greedy: bool = True
    config: dict = field(default_factory=dict)


def run_bench(prompts: Sequence[tuple[BenchPrompt, Sequence[int]]], methods: dict[str, Method], *,
              warmup: int = 1, baselines: Iterable[str] = DEFAULT_BASELINES, reference: str | None = REFERENCE,
              greedy: bool = True, skipped: dict[str, str] | None = None, progress: bool = True,
              config: dict | None = None, eos_token_ids: Iterable[int] = ()) -> BenchResult:
    """Run every method on every (prompt, ids), interleaved per prompt; warm-up runs are excluded.

    A method that raises is dropped from the run (its records too) and listed in ``skipped``
    with the error, so one broken drafter does not hide the others. The output comparison
    (:func:`compare_outputs`) takes the ids a method stops at from its ``eos_token_ids``
    attribute, or from the ``eos_token_ids`` argument for methods without one.
    """
    from tqdm import tqdm

    if not prompts:
        raise BenchError("no prompts to benchmark")
    ids_seen = [p.id for p, _ in prompts]
    if len(set(ids_seen)) != len(ids_seen):
        raise BenchError("prompt ids must be unique within a run")
    if not methods:
        raise BenchError("no methods to benchmark" + (f" (skipped: {skipped})" if skipped else ""))
    skipped = dict(skipped or {})
    live = dict(methods)
    records: list[Record] = []

    def call(name: str, prompt: BenchPrompt, ids: Sequence[int]) -> Record | None:
        try:
            t0 = time.perf_counter()
            out = _as_output(live[name](list(ids)))
            wall = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported in the result and on stderr, never hidden
            skipped[name] = f"failed on prompt {prompt.id}: {type(e).__name__}: {e}"
            print(f"[bench] method {name!r} failed and is dropped: {type(e).__name__}: {e}\n"
                  + traceback.format_exc(limit=3), file=sys.stderr)
            del live[name]
            return None
        return make_record(name, prompt, ids, out, wall)

    for w in range(warmup):
        p, ids = prompts[w % len(prompts)]
        for name in list(live):
            call(name, p, ids)

    names = list(live)
    bar = tqdm(total=len(prompts) * len(names), desc="bench", unit="run", disable=not progress, file=sys.stderr)
    for i, (p, ids) in enumerate(prompts):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotate the order so no method always runs first
            if name not in live:
                bar.update(1)
                continue
            bar.set_postfix_str(f"{name} q{p.id}")
            r = call(name, p, ids)
            if r is not None:
                records.append(r)
            bar.update(1)
    bar.close()

    records = [r for r in records if r.method in live]
    ref = reference if reference in live else None
    if greedy and ref is not None:
        default_eos = frozenset(int(t) for t in eos_token_ids)
        eos = {n: default_eos if getattr(m, "eos_token_ids", None) is None
               else frozenset(int(t) for t in m.eos_token_ids) for n, m in methods.items()}
        ref_ids = {r.prompt_id: r.token_ids for r in records if r.method == ref}
        for r in records:
            r.equal_to_reference, r.first_mismatch, r.mismatch = compare_outputs(
                ref_ids[r.prompt_id], r.token_ids, reference_eos=eos[ref], other_eos=eos[r.method])
    return BenchResult(records, [n for n in names if n in live], skipped, ref,
                       [b for b in baselines if b in live], greedy, dict(config or {}))


# ---------------------------------------------------------------------------------------------
# metrics (all computed from the records)


def throughput(records: Iterable[Record]) -> float:
    """sum(new_tokens) / sum(wall_s)."""
    rs = list(records)
    wall = sum(r.wall_s for r in rs)
    return sum(r.new_tokens for r in rs) / wall if wall > 0 else 0.0


def acceptance_per_depth(records: Iterable[Record]) -> list[float]:
    """Pooled P(accepted >= d | tree depth >= d) for d = 1..max depth over all steps of the records."""
    from .engine import acceptance_per_depth as pooled

    return pooled((d, a - 1) for r in records if r.accepted_lengths
                  for d, a in zip(r.tree_depths, r.accepted_lengths))


def _group_summary(rs: list[Record], base_tps: dict[str, float]) -> dict:
    tps = throughput(rs)
    acc = [a for r in rs if r.accepted_lengths for a in r.accepted_lengths]
    wall = sum(r.wall_s for r in rs)
    timed = [r for r in rs if r.t_verify is not None]
    split = None
    if timed and len(timed) == len(rs) and wall > 0:
        draft = sum(r.t_draft for r in rs)
        verify = sum(r.t_verify for r in rs)
        split = {"draft": draft / wall, "verify": verify / wall, "rest": 1 - (draft + verify) / wall,
                 "prefill_s": sum(r.t_prefill or 0.0 for r in rs), "accept_s": sum(r.t_rest for r in rs)}
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
        out[cat] = {m: _group_summary([r for r in rs if r.method == m], base_tps)
                    for m in result.methods if any(r.method == m for r in rs)}
    return out


def mismatches(result: BenchResult, decode: Callable[[list[int]], str] | None = None, context: int = 6) -> list[dict]:
    """Every record whose output differs from the reference's, with the tokens around the first difference."""
    ref = {r.prompt_id: r for r in result.records if r.method == result.reference}
    out = []
    for r in result.records:
        if r.equal_to_reference is False:
            i = r.first_mismatch
            lo = max(0, i - context)
            exp, got = ref[r.prompt_id].token_ids[lo:i + context], r.token_ids[lo:i + context]
            m = {"method": r.method, "prompt_id": r.prompt_id, "category": r.category, "position": i,
                 "kind": r.mismatch, "reference_length": len(ref[r.prompt_id].token_ids),
                 "method_length": len(r.token_ids), "reference_tokens": exp, "method_tokens": got}
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
        for k in ("command", "model", "dataset", "prompts", "max_new_tokens", "decoding", "device", "dtype",
                  "torch_threads", "date"):
            if k in cfg:
                lines.append(f"- {k}: `{cfg[k]}`")
        lines.append("")
    lines += ["tokens/s = total new tokens / total wall time (prefill included) per method; speedup = ratio of "
              "tokens/s over the same prompts; mean accepted = tokens per verify step incl. the bonus token; "
              f"equality is against `{result.reference}`: same tokens and length (a shorter output must end at "
              "EOS where the other has that EOS).", ""]
    base = result.baselines
    head = (["method", "tok/s"] + [f"× vs {b}" for b in base]
            + ["mean accepted", "accept. d1..d5", "draft / verify / rest", f"= {result.reference}"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in summary[ALL_CATEGORIES].items():
        apd = s["acceptance_per_depth"]
        split = s["time_split"]
        row = [f"`{m}`", f"{s['tokens_per_s']:.1f}"]
        row += [_fmt(s["speedup"].get(b), ".2f", "×") for b in base]
        row += [_fmt(s["mean_accepted_length"]),
                " ".join(f"{a:.2f}" for a in apd[:5]) if apd else "–",
                (f"{split['draft']:.0%} / {split['verify']:.0%} / {split['rest']:.0%}" if split else "–"),
                f"{s['equal']}/{s['compared']}" if s["compared"] else "–"]
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
    lines += ["## Output mismatches", ""]
    if result.reference is None or not result.greedy:
        lines.append("not checked (" + ("sampling" if not result.greedy else "no reference method in the run") + ")")
    elif not mism:
        lines.append(f"none: every method's greedy output equals `{result.reference}`.")
    else:
        lines += ["| method | prompt | category | first diff at | kind | length ref / method | reference | method |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in mism:
            ref = x.get("reference_text", x["reference_tokens"])
            got = x.get("method_text", x["method_tokens"])
            lines.append(f"| `{x['method']}` | {x['prompt_id']} | {x['category']} | {x['position']} | {x['kind']} | "
                         f"{x['reference_length']} / {x['method_length']} | "
                         f"{json.dumps(ref, ensure_ascii=False)} | {json.dumps(got, ensure_ascii=False)} |")
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
            ys = [(summary[c].get(m, {}).get("speedup", {}).get(b) or 0.0) if b else
                  summary[c].get(m, {}).get("tokens_per_s", 0.0) for c in cats]
            ax.bar([i + (j - (len(result.methods) - 1) / 2) * width for i in range(len(cats))], ys, width, label=m)
        if b:
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(cats)), cats, rotation=20)
        ax.set_ylabel(f"speedup vs {b}" if b else "tokens/s")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accepted_hist(result: BenchResult, path: Path) -> None:
    """Histogram of tokens committed per verify step (bonus included), per method that drafted tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = {m: [a for r in result.records if r.method == m and r.accepted_lengths for a in r.accepted_lengths]
           for m in result.methods}
    drafted = {r.method for r in result.records if r.tree_sizes and max(r.tree_sizes) > 1}
    per = {m: v for m, v in per.items() if v and m in drafted}  # plain decoding is all 1s: left out
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if per:
        top = max(max(v) for v in per.values())
        width = 0.8 / len(per)
        for j, (m, v) in enumerate(per.items()):
            xs = list(range(1, top + 1))
            ys = [sum(a == x for a in v) / len(v) for x in xs]
            ax.bar([x + (j - (len(per) - 1) / 2) * width for x in xs], ys, width,
                   label=f"{m} (mean {sum(v) / len(v):.2f})")
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no method drafted any tokens", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tokens committed per verify step (bonus included)")
    ax.set_ylabel("fraction of steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: BenchResult, out_dir: str | Path, decode: Callable[[list[int]], str] | None = None
                 ) -> dict[str, Path]:
    """Write records.json, report.md, speedup_by_category.png and accepted_length_hist.png into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    mism = mismatches(result, decode)
    paths = {"json": out / "records.json", "markdown": out / "report.md",
             "speedup_png": out / "speedup_by_category.png", "hist_png": out / "accepted_length_hist.png"}
    doc = {"config": result.config, "methods": result.methods, "skipped": result.skipped,
           "reference": result.reference, "baselines": result.baselines, "greedy": result.greedy,
           "summary": summary, "mismatches": mism,
           "records": [asdict(r) | {"mean_accepted_length": r.mean_accepted_length} for r in result.records]}
    paths["json"].write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths["markdown"].write_text(markdown_report(result, summary, mism), encoding="utf-8")
    plot_speedup(summary, result, paths["speedup_png"])
    plot_accepted_hist(result, paths["hist_png"])
    return paths


# ---------------------------------------------------------------------------------------------
# building the real methods for a loaded model


def known_methods() -> list[str]:
    """Every method name: the baselines plus every registered drafter."""
    from .drafters import DRAFTERS

    return ["hf", "hf-pld", "plain"] + [d for d in DRAFTERS if d != "none"] + ["llama.cpp", "llama.cpp-pld"]


def parse_methods(spec: str) -> list[str]:
    """'all' or a comma list -> method names; 'none' means plain; unknown names list the choices."""
    known = known_methods()
    names = known if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    names = ["plain" if n == "none" else n for n in names]
    bad = [n for n in names if n not in known]
    if bad:
        raise BenchError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(known)} or 'all'")
    return list(dict.fromkeys(names))


def load_hf_baseline(path: Path, dtype: Any, device: str) -> Any:
    """The same weights as a transformers ``AutoModelForCausalLM`` (GGUF dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    if path.is_file():
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.to(device).eval()


def build_methods(names: Sequence[str], llm: Any, model_path: Path, config: Any, *, dtype: Any = None,
                  heads: str | None = "default", pld_tokens: int = 10) -> tuple[dict[str, Method], dict[str, str]]:
    """Construct the requested methods; each one that cannot be built is skipped with the reason."""
    methods: dict[str, Method] = {}
    skipped: dict[str, str] = {}
    sp = config.sampling
    n = config.max_new_tokens
    hf_model = None
    llama_cpp: dict[str, Any] = {}
    for name in names:
        try:
            if name in ("hf", "hf-pld"):
                if hf_model is None:
                    hf_model = load_hf_baseline(model_path, dtype, llm.device)
                methods[name] = HFMethod(hf_model, n, pld_tokens if name == "hf-pld" else None, sp.temperature,
                                         sp.top_p, sp.top_k, sp.seed)
            elif name in ("llama.cpp", "llama.cpp-pld"):
                methods[name] = _llama_cpp_method(name, model_path, config, pld_tokens, llama_cpp)
            elif name == "plain":
                methods[name] = EngineMethod(llm.engine, config, None)
            else:
                from .drafters import make_drafter

                d = make_drafter(name, llm, heads)
                methods[name] = EngineMethod(llm.engine, config, d)
        except Exception as e:  # noqa: BLE001 - reported as skipped with the reason
            skipped[name] = f"{type(e).__name__}: {e}"
    return methods, skipped


def _llama_cpp_method(name: str, model_path: Path, config: Any, pld_tokens: int, cache: dict) -> LlamaCppMethod:
    try:
        import llama_cpp
    except ImportError as e:
        raise BenchError("llama-cpp-python is not installed (optional; `pip install llama-cpp-python` builds "
                         "llama.cpp from source)") from e
    if not model_path.is_file():
        raise BenchError(f"llama.cpp needs a GGUF file; {model_path} is a directory")
    import torch

    kw: dict[str, Any] = dict(model_path=str(model_path), n_ctx=4096, n_threads=torch.get_num_threads(),
                              verbose=False, logits_all=False)
    if name == "llama.cpp-pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=pld_tokens)
    sp = config.sampling
    return LlamaCppMethod(llama_cpp.Llama(**kw), config.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed)


# ---------------------------------------------------------------------------------------------
# CLI


def cmd_bench(a: argparse.Namespace) -> int:
    """`treedraft bench`: load, build methods, run interleaved, write the report."""
    import torch

    from . import load
    from .api import pick_device, pick_dtype
    from .models.registry import resolve

    methods_wanted = parse_methods(a.methods)
    if a.threads is not None:
        if a.threads < 1:
            raise BenchError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    if a.dataset:
        dataset: Path | None = Path(a.dataset)
        prompts = load_prompts(dataset)
    else:
        dataset = find_default_dataset()
        if dataset is not None:
            prompts = load_prompts(dataset)
        else:
            print(f"[bench] {DEFAULT_DATASET} not found; using {len(BUILTIN_PROMPTS)} built-in prompts "
                  "(pass --dataset FILE)", file=sys.stderr)
            prompts = [BenchPrompt(f"builtin-{i}", c, t) for i, (c, t) in enumerate(BUILTIN_PROMPTS)]
    prompts = select_prompts(prompts, a.num_prompts)
    if a.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {a.max_new_tokens}")

    t = time.perf_counter()
    llm = load(a.model, drafter=None, device=a.device, dtype=a.dtype, runtime=a.runtime, weights=a.weights)
    cfg = llm.config(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                     seed=a.seed, max_tree_nodes=a.max_tree_nodes)
    encoded = [(p, llm.encode_prompt(p.text, raw=a.raw)) for p in prompts]
    dtype = pick_dtype(a.dtype, pick_device(a.device))
    methods, skipped = build_methods(methods_wanted, llm, resolve(a.model), cfg, dtype=dtype, heads=a.heads,
                                     pld_tokens=a.pld_tokens)
    print(f"[bench] loaded in {time.perf_counter() - t:.1f}s; methods: {', '.join(methods) or '-'}"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""), file=sys.stderr)
    for m, why in skipped.items():
        print(f"[bench] skipped {m}: {why}", file=sys.stderr)
    run_cfg = {"command": _command_line(a, dataset),
               "model": llm.model_name, "dataset": str(dataset) if dataset else "built-in prompts",
               "prompts": len(encoded), "max_new_tokens": a.max_new_tokens,
               "decoding": "greedy" if a.temperature == 0 else f"sampling T={a.temperature} top_p={a.top_p} "
                                                              f"top_k={a.top_k} seed={a.seed}",
               "device": llm.device, "dtype": str(dtype).removeprefix("torch."),
               "torch_threads": torch.get_num_threads(), "warmup": a.warmup, "max_tree_nodes": a.max_tree_nodes,
               "hf_prompt_lookup_num_tokens": a.pld_tokens,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
               "torch": torch.__version__, "platform": platform.platform()}
    try:
        import transformers
        run_cfg["transformers"] = transformers.__version__
    except ImportError:
        pass
    baselines = [b.strip() for b in a.baselines.split(",") if b.strip()]
    reference = next((m for m in (REFERENCE, "hf") if m in methods), None)
    result = run_bench(encoded, methods, warmup=a.warmup, baselines=baselines, reference=reference,
                       greedy=a.temperature == 0,
                       skipped=skipped, progress=not a.no_progress, config=run_cfg)
    paths = write_report(result, a.out, decode=lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=False))
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("[bench] wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _command_line(a: argparse.Namespace, dataset: Path | None) -> str:
    """The command that reproduces this run (options spelled out)."""
    import shlex

    parts = ["treedraft", "bench", "--methods", a.methods, "--max-new-tokens", str(a.max_new_tokens)]
    if a.dataset:
        parts += ["--dataset", a.dataset]
    if a.num_prompts is not None:
        parts += ["--num-prompts", str(a.num_prompts)]
    for opt, default in (("model", None), ("device", "auto"), ("dtype", "fp32"), ("runtime", "auto"), ("weights", "auto"),
                         ("temperature", 0.0), ("seed", 0), ("top_p", 1.0), ("top_k", 0), ("warmup", 1),
                         ("max_tree_nodes", 64), ("pld_tokens", 10), ("heads", "default"), ("baselines", "hf,plain")):
        v = getattr(a, opt)
        if opt == "model" or v != default:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if a.threads is not None:
        parts += ["--threads", str(a.threads)]
    if a.raw:
        parts.append("--raw")
    parts += ["--out", str(a.out)]
    return shlex.join(parts)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `treedraft bench` to the CLI."""
    from .models.registry import DEFAULT_MODEL

    b = subparsers.add_parser("bench", help="benchmark decoding methods side by side (Spec-Bench style)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--dataset", default=None,
                   help=f"jsonl of {{question_id, category, turns}} or {{prompt}} (default: {DEFAULT_DATASET} "
                        "next to the repo when present, else a few built-in prompts)")
    b.add_argument("--methods", default="all",
                   help="comma list or 'all' (hf, hf-pld, plain, every drafter, llama.cpp, llama.cpp-pld); "
                        "methods that cannot be built are skipped with the reason")
    b.add_argument("--baselines", default=",".join(DEFAULT_BASELINES), help="speedups are reported against these")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--num-prompts", type=int, default=None,
                   help="use this many prompts, round-robin over categories (default: all)")
    b.add_argument("--out", default="benchmarks/results/bench", help="output directory")
    b.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per method")
    b.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory")
    b.add_argument("--heads", default="default", help="Medusa heads directory (default: the shipped ones)")
    b.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    b.add_argument("--dtype", default="fp32", help="fp32 (default, as the HF baseline), bf16, fp16, auto")
    b.add_argument("--runtime", default="auto", help="own, hf or auto (treedraft's target runtime)")
    b.add_argument("--weights", default="auto", choices=("auto", "fp32", "int8", "int4"),
                   help="target linear weights on cpu (see `treedraft generate --help`)")
    b.add_argument("--raw", action="store_true", help="no chat template")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--max-tree-nodes", type=int, default=64)
    b.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-pld / llama.cpp-pld")
    b.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); 1 is often faster on a busy machine")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)
