"""EAGLE self-distillation data from the serving loop: greedy answers and features in one pass.

The target answers every prompt greedily through the batched :class:`~treedraft.scheduler.Scheduler`
(the loop the server runs: ``concurrency`` requests per step, one packed forward, the fused native
decode step with int4/int8 weights), with no drafter. Each step already returns the target's
final-norm hidden states of the rows it ran (the prompt positions at prefill, the root at every decode
step); the scheduler hands them on as ``Request.path_hidden`` (what EAGLE reads at inference), so the
features cost no second, teacher-forced pass: they are bitwise the features the drafter sees when it
serves (same kernels, same row-invariant arithmetic).

Shards have the layout of :func:`treedraft.training.data.generate_dataset` with ``keep_prompt=True``
(row j: hidden f_j fp16, token x_{j+1}, seq = prompt index, answer = 1 where x_{j+1} is the model's own),
so :func:`treedraft.training.eagle_train.load_eagle_shards` reads both. Prompts stream through the
scheduler across shard boundaries; a shard is written (atomically) when all its prompts are answered,
finished shards are skipped on resume, and ``progress.json`` records prompts, tokens and tok/s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from .data import DataCacheMismatchError, _check_existing_shards, _write_meta, check_meta, dataset_meta, encode_fitting

PROGRESS_FILE = "progress.json"


@torch.inference_mode()
def scheduled_greedy(
    engine,
    prompts: Sequence[tuple[int, Sequence[int]]],
    max_new_tokens: int,
    eos: frozenset[int],
    concurrency: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    top_p: float = 1.0,
    keep_hidden: bool = True,
) -> Iterator[tuple[int, list[int], Tensor | None]]:
    """Greedy answers through the batched scheduler; yields (key, answer ids, hidden (P - 1 + A, H)) as they finish.

    prompts: (key, prompt ids) pairs, admitted in order with at most ``concurrency`` in flight. An answer
    ends at its first EOS (kept) or after ``max_new_tokens``. hidden[j] is the target's final-norm hidden
    state at position j, j = 0 .. P + A - 2 (the last answer token has no successor to predict).
    temperature > 0: sampled answers instead (the prompt with key i drawn with seed ``seed + i``, so a resumed
    run draws the same answers): other contexts over the same prompts, which the EAGLE loss can use as they are
    (its token targets are the target's distributions at each position, not the sampled tokens).
    """
    from ..engine import GenerationConfig
    from ..sampling import SamplingParams
    from ..scheduler import Scheduler

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sched = Scheduler(engine)
    todo = list(prompts)[::-1]  # pop() from the end = admission in input order
    parts: dict[int, list[Tensor]] = {}  # id(request) -> its hidden chunks so far
    while todo or sched.active:
        while todo and len(sched) < concurrency:
            key, ids = todo.pop()
            sampling = (
                SamplingParams(temperature, top_p=top_p, seed=seed + key) if temperature > 0 else SamplingParams()
            )
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, max_tree_nodes=1, ignore_eos=True, sampling=sampling)
            req = sched.add(ids, cfg, drafter=None, tag=key)
            req.keep_hidden = keep_hidden  # no drafter, but its hidden states are the data
            parts[id(req)] = []
        for req, _ in sched.step():
            if req.error is not None:
                raise req.error
            h = req.take_hidden()  # (n, H) rows committed this step; taken so they never pile up
            if h is not None:
                parts[id(req)].append(h.to(torch.float16))
            out = req.tokens[len(req.prompt) :]
            end = next((i + 1 for i, t in enumerate(out) if t in eos), None)
            if end is None and not req.done:
                continue
            answer = out[:end] if end is not None else out
            sched.remove(req)
            chunks = parts.pop(id(req))
            hid = torch.cat(chunks)[: len(req.prompt) - 1 + len(answer)] if keep_hidden else None
            yield req.tag, answer, hid


def _write_progress(out: Path, **facts) -> None:
    from ..models.cache import atomic_write_text

    atomic_write_text(out / PROGRESS_FILE, json.dumps(facts, indent=1))


def generate_eagle_dataset(
    llm,
    prompts: Sequence[str],
    out_dir: str | Path,
    max_new_tokens: int = 256,
    concurrency: int = 8,
    max_prompt_tokens: int = 384,
    shard_size: int = 32,
    progress: bool = True,
    prompt_file: str | Path | None = None,
    max_shards: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> Path:
    """Generate (resumably) EAGLE shards for ``prompts`` into ``out_dir`` with the batched scheduler.

    Prompts are encoded as served (``llm.encode_prompt``); longer than ``max_prompt_tokens`` are skipped.
    ``meta.json`` is checked/written as by :func:`treedraft.training.data.generate_dataset` (resuming with
    other settings raises DataCacheMismatchError); finished shards are kept and skipped. max_shards: only
    the first N shards are generated (the rest can follow in a later run with a larger N or None).
    temperature > 0: sampled answers (seed + prompt index per prompt; see :func:`scheduled_greedy`), recorded in
    meta.json so that a resumed run cannot mix greedy and sampled shards.
    """
    from tqdm import tqdm

    from ..models.cache import save_tensors

    out = Path(out_dir)
    encoded = encode_fitting(llm, prompts, max_prompt_tokens)
    meta = dataset_meta(llm, prompts, len(encoded), max_new_tokens, max_prompt_tokens, shard_size, prompt_file)
    meta["keep_prompt"] = True
    meta["temperature"] = float(temperature)
    if temperature > 0:
        meta["seed"] = int(seed)
    old = check_meta(out, meta)
    if old and "temperature" not in old and temperature > 0:  # written before the key existed: greedy answers
        raise DataCacheMismatchError(
            f"data directory {out} holds greedy answers; sampled ones (--gen-temperature {temperature}) go into "
            "another directory (--train-data)"
        )
    meta["shard_size"] = shard_size = int(old.get("shard_size") or shard_size)
    shards = [encoded[s : s + shard_size] for s in range(0, len(encoded), shard_size)]
    _check_existing_shards(out, shards)
    out.mkdir(parents=True, exist_ok=True)
    _write_meta(out, {**old, **meta, "complete": False})
    paths = [out / f"shard_{si:05d}.safetensors" for si in range(len(shards))]
    upto = len(shards) if max_shards is None else min(max_shards, len(shards))
    pending = [si for si, p in enumerate(paths[:upto]) if not p.is_file()]
    shard_of = {idx: si for si in pending for idx, _ in shards[si]}
    done_before = sum(len(s) for si, s in enumerate(shards[:upto]) if si not in set(pending))
    results: dict[int, dict[int, tuple[list[int], Tensor]]] = {si: {} for si in pending}
    bar = tqdm(
        total=sum(map(len, shards[:upto])), initial=done_before, desc="eagle data", disable=not progress, unit="prompt"
    )
    t0, new_tokens, written = time.perf_counter(), 0, upto - len(pending)
    feed = [(idx, ids) for si in pending for idx, ids in shards[si]]
    for idx, answer, hid in scheduled_greedy(
        llm.engine, feed, max_new_tokens, llm.tokenizer.eos_token_ids, concurrency, temperature, seed
    ):
        si = shard_of[idx]
        results[si][idx] = (answer, hid)
        new_tokens += len(answer)
        bar.update(1)
        if len(results[si]) < len(shards[si]):
            continue
        toks, hids, seqs, ans = [], [], [], []
        for i, ids in shards[si]:  # prompt order, whatever order they finished in
            a, h = results[si].pop(i)
            head = list(ids[1:])  # token j follows hidden j: the prompt's next tokens, then the answer
            toks.append(torch.tensor(head + a, dtype=torch.int32))
            hids.append(h.cpu())
            seqs.append(torch.full((len(head) + len(a),), i, dtype=torch.int32))
            ans.append(torch.tensor([0] * len(head) + [1] * len(a), dtype=torch.int8))
        tensors = {
            "tokens": torch.cat(toks),
            "hidden": torch.cat(hids),
            "seq": torch.cat(seqs),
            "answer": torch.cat(ans),
        }
        tmp = paths[si].with_suffix(".tmp")
        save_tensors(tensors, tmp)
        tmp.replace(paths[si])
        del results[si]
        written += 1
        dt = time.perf_counter() - t0
        _write_progress(
            out,
            shards_done=written,
            shards=upto,
            prompts_done=bar.n,
            prompts=bar.total,
            new_tokens_this_run=new_tokens,
            seconds_this_run=round(dt, 1),
            tokens_per_second=round(new_tokens / max(dt, 1e-9), 2),
            concurrency=concurrency,
            updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
    bar.close()
    _write_meta(out, {**old, **meta, "complete": upto == len(shards)})
    return out
