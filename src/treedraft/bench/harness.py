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
- output equality (greedy, or sampling with a seed: seeded draws are coupled, so a seeded speculative output
  equals the seeded plain one): the method's ids vs the reference's (treedraft plain), same tokens
  and same length; the one allowed length difference is an output that ended at an EOS token
  (the last id of the shorter one is one its own method stops at) where the other has the same
  token and ran on (ignore_eos, or a method with a different EOS set). A shorter output that did
  not end at EOS is a "truncated" mismatch, a longer one past a reference that did not end at EOS a
  "longer" one; both are listed with the differing tokens, never hidden.
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..drafters.hybrid import fresh_copy
from ..prompts import MT_BENCH_FILE, SHARED_DATA, Prompt, PromptFileError, find_shared_data, read_prompt_file

DEFAULT_DATASET = SHARED_DATA / MT_BENCH_FILE
BASELINE_METHODS = ("hf", "hf-pld", "plain", "llama.cpp", "llama.cpp-pld")
DEFAULT_BASELINES = ("hf", "plain")
REFERENCE = "plain"
BUSY_SUFFIX = "+busy"  # records of a method's runs while another process keeps one core busy (--busy-core)

# Used only when no dataset is given and the MT-Bench file is not found next to the repo.
BUILTIN_PROMPTS = (
    ("writing", "Write a short, friendly email inviting a colleague to a team lunch next Friday."),
    ("coding", "Write a Python function that returns the n-th Fibonacci number, and explain it briefly."),
    ("math", "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps."),
    ("reasoning", "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain."),
    (
        "extraction",
        "List the countries and capitals in this text: Paris is the capital of France, "
        "Rome of Italy, and Madrid of Spain.",
    ),
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
    """treedraft's one decode loop (with EOS handling) and a given drafter (None = plain decoding)."""

    engine: Any  # treedraft.text.TextGenerator (the engine wrapped by the text layer: EOS ends a generation)
    config: Any  # treedraft.engine.GenerationConfig
    drafter: Any = None
    # each call drafts with a fresh copy of ``drafter`` (nothing learned from earlier runs, e.g. an empty
    # suffix index), so a run's speed does not depend on which runs came before it (--fresh-drafter-state)
    fresh_state: bool = False

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids this method stops at (the engine's; none with ignore_eos)."""
        return frozenset() if getattr(self.config, "ignore_eos", False) else frozenset(self.engine.eos_token_ids)

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        """Generate with the engine; stats are the engine's own."""
        return self._run(prompt_ids, fresh_copy(self.drafter) if self.fresh_state else self.drafter)

    def warm(self, prompt_ids: list[int]) -> MethodOutput:
        """An untimed warm-up run whose drafter is a fresh copy: what it learns (e.g. its output in a suffix
        index) never reaches the timed runs, or the timed run of the warm-up prompt would draft its own text."""
        return self._run(prompt_ids, fresh_copy(self.drafter))

    def _run(self, prompt_ids: list[int], drafter: Any) -> MethodOutput:
        r = self.engine.generate(prompt_ids, self.config, drafter)
        return MethodOutput(list(r.token_ids), r.stats, r.finish_reason)


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


def make_record(
    method: str, prompt: BenchPrompt, prompt_ids: Sequence[int], out: MethodOutput, wall_s: float
) -> Record:
    """Build a record from a method's output and the harness's wall time."""
    ids = [int(t) for t in out.token_ids]
    r = Record(
        method,
        prompt.id,
        prompt.category,
        len(prompt_ids),
        len(ids),
        wall_s,
        len(ids) / wall_s if wall_s > 0 else 0.0,
        out.finish_reason,
        ids,
    )
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


def compare_outputs(
    reference: Sequence[int], other: Sequence[int], *, reference_eos: Iterable[int] = (), other_eos: Iterable[int] = ()
) -> tuple[bool, int | None, str | None]:
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


@contextmanager
def busy_process() -> Iterator[subprocess.Popen]:
    """Keep one core busy with a spinning child process for the duration of the block."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)  # let it start spinning before the timed call
        yield hog
    finally:
        hog.kill()
        hog.wait()


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
    seeded: bool = False  # sampled with a seed: outputs checked as under greedy


def run_bench(
    prompts: Sequence[tuple[BenchPrompt, Sequence[int]]],
    methods: dict[str, Method],
    *,
    warmup: int = 1,
    baselines: Iterable[str] = DEFAULT_BASELINES,
    reference: str | None = REFERENCE,
    greedy: bool = True,
    seeded: bool = False,
    skipped: dict[str, str] | None = None,
    progress: bool = True,
    config: dict | None = None,
    eos_token_ids: Iterable[int] = (),
    busy_core: bool = False,
) -> BenchResult:
    """Run every method on every (prompt, ids), interleaved per prompt; warm-up runs are excluded.

    A method that raises is dropped from the run (its records too) and listed in ``skipped``
    with the error, so one broken drafter does not hide the others. With ``busy_core`` every timed
    run is followed by a second run of the same method and prompt while a spinning process keeps one
    core busy (issue 11's busy-machine check), recorded as method ``NAME+busy``. The output comparison
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

    def call(name: str, prompt: BenchPrompt, ids: Sequence[int], warm: bool = False) -> Record | None:
        try:
            fn = getattr(live[name], "warm", None) if warm else None  # warm-ups learn nothing that is kept
            t0 = time.perf_counter()
            out = _as_output((fn or live[name])(list(ids)))
            wall = time.perf_counter() - t0
        except Exception as e:
            skipped[name] = f"failed on prompt {prompt.id}: {type(e).__name__}: {e}"
            print(
                f"[bench] method {name!r} failed and is dropped: {type(e).__name__}: {e}\n"
                + traceback.format_exc(limit=3),
                file=sys.stderr,
            )
            del live[name]
            return None
        return make_record(name, prompt, ids, out, wall)

    for w in range(warmup):
        p, ids = prompts[w % len(prompts)]
        for name in list(live):
            call(name, p, ids, warm=True)

    names = list(live)
    if not names:  # every method failed in the warm-up: said with why (it was a ZeroDivisionError)
        raise BenchError("every method failed: " + "; ".join(f"{n}: {why}" for n, why in skipped.items()))
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
                if busy_core:
                    with busy_process():
                        rb = call(name, p, ids)
                    if rb is not None:
                        rb.method = name + BUSY_SUFFIX
                        records.append(rb)
            bar.update(1)
    bar.close()

    records = [r for r in records if r.method.removesuffix(BUSY_SUFFIX) in live]
    ref = reference if reference in live else None
    if not greedy and ref is not None and not isinstance(methods.get(ref), EngineMethod):
        ref = None  # sampled: another library's draws are not treedraft's coupled ones; nothing to compare with
    if (greedy or seeded) and ref is not None:
        default_eos = frozenset(int(t) for t in eos_token_ids)
        eos = {
            n: default_eos if getattr(m, "eos_token_ids", None) is None else frozenset(int(t) for t in m.eos_token_ids)
            for n, m in methods.items()
        }
        ref_ids = {r.prompt_id: r.token_ids for r in records if r.method == ref}
        for r in records:
            if not greedy and not isinstance(methods.get(r.method.removesuffix(BUSY_SUFFIX)), EngineMethod):
                continue  # sampled: only treedraft's own methods share the seeded (coupled) draws
            r.equal_to_reference, r.first_mismatch, r.mismatch = compare_outputs(
                ref_ids[r.prompt_id],
                r.token_ids,
                reference_eos=eos[ref],
                other_eos=eos[r.method.removesuffix(BUSY_SUFFIX)],
            )
    kept = [n for n in names if n in live]
    if busy_core:
        kept += [n + BUSY_SUFFIX for n in kept]
    return BenchResult(
        records,
        kept,
        skipped,
        ref,
        [b for b in baselines if b in live],
        greedy,
        dict(config or {}),
        seeded=seeded and not greedy,
    )
