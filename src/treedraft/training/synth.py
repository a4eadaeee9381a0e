"""`treedraft synth-prompts`: user requests written by the target model itself, as training prompts for drafters.

An instruction-tuned model that is given its chat template up to the point where the user's text begins goes on
to write a user's request, drawn from the kinds of requests it was tuned on (Magpie: Xu et al. 2024, "Alignment
Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing"). For a drafter that is what matters: it is
trained on the target's answers (self-distillation), and those should answer the requests the model will be
asked, across its topics; a user with no prompt set of their own gets one from the model, and one with a small
set can widen it. The requests are sampled (per request key ``seed + key``, so a rerun or a resumed run draws the
same ones whatever the batching), kept only when they end with the template's end of turn inside the token
limit, are not mostly non-letters or repetitive, and are not a repeat of an earlier one (case and spacing
ignored). Kept requests go to a ``{"id", "category", "prompt"}`` jsonl that ``train-eagle --prompts`` and
``train-heads --prompts`` read; every drawn key is recorded (kept, or in the ``.rejected.jsonl`` file beside it
with the reason), so a resumed run continues where the last one stopped, and a torn last line (a killed run) is
dropped with a warning.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

PROBES = ("Hello there", "?! 42")  # two user texts with different first characters (the template prefix is shared)


class SynthError(ValueError):
    """Bad input to synth-prompts; the message says what to change."""


@dataclass(frozen=True)
class SynthConfig:
    """How requests are drawn and which are kept."""

    num: int = 1000  # request keys drawn: 0 .. num - 1
    max_new_tokens: int = 128  # a request must end (end of turn) within this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    min_chars: int = 12
    max_chars: int = 2000

    def __post_init__(self) -> None:
        if self.num < 1:
            raise SynthError(f"--num must be >= 1, got {self.num}")
        if self.max_new_tokens < 1:
            raise SynthError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise SynthError(f"--temperature must be > 0 (requests are sampled), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SynthError(f"--top-p must be in (0, 1], got {self.top_p}")


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template's ids up to where a user's text begins (the common prefix of two one-turn chats)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SynthError("synth-prompts needs a chat model: this model has no chat template to write requests in")
    a, b = (tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROBES)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == 0:
        raise SynthError("the chat template puts nothing before the user's text; there is no prefix to continue")
    return list(a[:n])


def reject_reason(text: str, ended: bool, cfg: SynthConfig) -> str | None:
    """Why a drawn request is not kept (None: keep it)."""
    t = text.strip()
    if not ended:
        return "no end of turn"
    if len(t) < cfg.min_chars:
        return "too short"
    if len(t) > cfg.max_chars:
        return "too long"
    if "<|" in t or "|>" in t:
        return "template marker"
    if sum(c.isalpha() for c in t) < 0.3 * len(t):
        return "mostly non-letters"
    words = t.lower().split()
    if len(words) >= 20 and len(set(words)) < 0.3 * len(words):
        return "repetitive"
    return None


def normalize(text: str) -> str:
    """The form duplicates are compared in: lower case, runs of white space as one space."""
    return " ".join(text.lower().split())


def _read_jsonl(path: Path) -> list[dict]:
    """Records of a jsonl file we wrote; a torn last line (no newline or not JSON) is cut off with a warning."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    good, size = [], 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if last and not line:
            break
        try:
            rec = json.loads(line) if not last else None  # a last line without its newline is torn
        except ValueError:  # not JSON, or not UTF-8
            rec = None
        if rec is None and not last:
            raise SynthError(f"{path}: line {i + 1} is not JSON; fix or remove it (only a torn last line is dropped)")
        if rec is None:
            print(
                f"warning: {path}: dropping a torn line {i + 1} (an interrupted run); it is drawn again",
                file=sys.stderr,
            )
            with open(path, "r+b") as f:
                f.truncate(size)
            break
        if not isinstance(rec, dict) or not isinstance(rec.get("key"), int):
            raise SynthError(
                f"{path}: line {i + 1} has no integer 'key' ({line[:80]!r}); was it written by synth-prompts?"
            )
        good.append(rec)
        size += len(line) + 1
    return good


_META_FLAGS = {
    "model": "--model",
    "weights": "--weights",
    "dtype": "--dtype",
    "runtime": "--runtime",
    "pre_query_ids": "the chat template (--model)",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "seed": "--seed",
}


def _check_meta(meta_path: Path, meta: dict, out: Path) -> None:
    """Refuse to continue ``out`` with other settings than it was drawn with (the .meta.json beside it)."""
    try:
        old = json.loads(meta_path.read_text())
    except ValueError as e:
        raise SynthError(
            f"{meta_path} is not valid JSON ({e}); delete {out} and its side files to start over"
        ) from None
    diff = [k for k in meta if k in old and old[k] != meta[k]]
    if diff:
        what = "; ".join(f"{_META_FLAGS.get(k, k)}: {old[k]!r} there, {meta[k]!r} now" for k in diff)
        raise SynthError(f"{out} was drawn with other settings ({what}); use those to continue it, or another --out")


def synthesize_prompts(
    engine,
    tokenizer,
    out: str | Path,
    cfg: SynthConfig,
    concurrency: int = 8,
    progress: bool = True,
    model_name: str = "",
    load_settings: dict | None = None,
) -> dict:
    """Draw requests ``0 .. cfg.num - 1`` (resumably) into ``out``; returns counts (kept, rejected per reason).

    Results are written in key order (a finished request waits for the keys before it), so which of two equal
    requests is kept, and the file's order, do not depend on the batching or on where a run was interrupted.
    load_settings: how the model was loaded (weights, dtype, runtime), recorded with the sampling settings.
    """
    from tqdm import tqdm

    from ..models.cache import atomic_write_text
    from .eagle_data import scheduled_greedy

    out = Path(out)
    if out.is_dir():  # (it said "exists but was not written by synth-prompts")
        raise SynthError(f"--out {out} is a directory; give the jsonl file to write, e.g. {out / 'prompts.jsonl'}")
    rejected_path = out.with_name(out.stem + ".rejected.jsonl")
    meta_path = out.with_name(out.stem + ".meta.json")
    prefix = pre_query_ids(tokenizer)
    meta = {"model": model_name, **(load_settings or {}), "pre_query_ids": prefix, **asdict(cfg)}
    meta.pop("num")  # more keys may be drawn later into the same file
    if meta_path.is_file():
        _check_meta(meta_path, meta, out)
    else:
        for f in (out, rejected_path):
            if f.exists():
                raise SynthError(
                    f"{f} exists but was not written by synth-prompts (no {meta_path.name}); choose another --out"
                )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(meta_path, json.dumps(meta, indent=1))
    kept, rejected = _read_jsonl(out), _read_jsonl(rejected_path)
    done = {r["key"] for r in kept} | {r["key"] for r in rejected}
    seen = {normalize(str(r.get("prompt", ""))) for r in kept}
    reasons = Counter(r.get("reason", "?") for r in rejected)
    todo = [k for k in range(cfg.num) if k not in done]
    eos = frozenset(tokenizer.eos_token_ids)
    t0, n_kept, n_new = time.perf_counter(), len(kept), 0
    bar = tqdm(total=cfg.num, initial=cfg.num - len(todo), desc="synth-prompts", disable=not progress, unit="req")
    waiting: dict[int, list[int]] = {}  # finished out of key order
    nxt = 0  # index into todo of the next key to write
    with open(out, "a", encoding="utf-8") as fk, open(rejected_path, "a", encoding="utf-8") as fr:
        for key, ids, _ in scheduled_greedy(
            engine,
            [(k, prefix) for k in todo],
            cfg.max_new_tokens,
            eos,
            concurrency,
            cfg.temperature,
            cfg.seed,
            cfg.top_p,
            keep_hidden=False,
        ):
            waiting[key] = ids
            while nxt < len(todo) and todo[nxt] in waiting:
                k = todo[nxt]
                ids = waiting.pop(k)
                nxt += 1
                ended = bool(ids) and ids[-1] in eos
                body = ids[:-1] if ended else ids
                shown = tokenizer.decode(body)
                text = shown.strip()
                why = reject_reason(text, ended, cfg)
                # a template token inside the request (decode drops it); compared before the strip, so one that
                # reads as white space at either end is caught too
                if why is None and tokenizer.decode(body, skip_special_tokens=False) != shown:
                    why = "special token"
                if why is None and normalize(text) in seen:
                    why = "duplicate"
                if why is None:
                    seen.add(normalize(text))
                    rec = {"id": f"synth-{cfg.seed}-{k}", "key": k, "category": "synth", "prompt": text}
                    fk.write(json.dumps(rec) + "\n")
                    fk.flush()
                    n_kept += 1
                else:
                    reasons[why] += 1
                    fr.write(json.dumps({"key": k, "reason": why}) + "\n")
                    fr.flush()
                n_new += 1
                bar.update(1)
        for f in (fk, fr):
            os.fsync(f.fileno())
    bar.close()
    return {
        "keys": cfg.num,
        "drawn_this_run": n_new,
        "kept": n_kept,
        "rejected": dict(sorted(reasons.items())),
        "seconds_this_run": round(time.perf_counter() - t0, 1),
        "out": str(out),
    }


def register(sub) -> None:
    """Add the synth-prompts subcommand."""
    from ..cli import add_model_args, add_threads_arg

    d = SynthConfig()
    p = sub.add_parser(
        "synth-prompts",
        help="have a chat model write user requests (Magpie), as training prompts for train-eagle / train-heads",
    )
    add_model_args(p, drafting=False, heads=False)
    add_threads_arg(p)
    p.add_argument("--out", required=True, help="jsonl of kept requests (resumable; .rejected.jsonl beside it)")
    p.add_argument("--num", type=int, default=d.num, help="requests to draw (keys 0 .. N-1; a larger N continues)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="longest request, in tokens")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed, help="request key k is drawn with seed + k")
    p.add_argument("--concurrency", type=int, default=8, help="requests written together by the batched scheduler")
    p.set_defaults(func=cmd_synth_prompts)


def cmd_synth_prompts(a) -> int:
    """Load the model, draw the requests, print the counts."""
    from .. import load
    from ..cli import apply_threads, model_kwargs

    if a.concurrency < 1:
        raise SynthError(f"--concurrency must be >= 1, got {a.concurrency}")
    cfg = SynthConfig(num=a.num, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    apply_threads(a.threads)
    llm = load(a.model, drafter=None, **model_kwargs(a))
    how = {"weights": a.weights, "dtype": a.dtype, "runtime": a.runtime}
    stats = synthesize_prompts(
        llm.engine, llm.tokenizer, a.out, cfg, a.concurrency, model_name=llm.model_name, load_settings=how
    )
    print(json.dumps(stats, indent=1))
    return 0
