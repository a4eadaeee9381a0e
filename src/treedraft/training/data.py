"""Self-distillation data: the frozen base model answers prompts; we keep its tokens and hidden states.

Answers are generated greedily in left-padded batches through the own runtime
(one forward per step for the whole batch) and written as resumable shards:
``shard_XXXXX.safetensors`` with ``tokens`` (N,) int32, ``hidden`` (N, H) fp16 and
``seq`` (N,) int32 (sequence index, so targets never cross sequences). Only
answer positions are kept (plus the last prompt position, which predicts the
first answer token). ``meta.json`` records what the shards were made from (model,
prompts, token limits); resuming a directory made with other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..interfaces import target_device
from ..prompts import read_prompt_file


def read_prompts(path: str | Path) -> list[str]:
    """Prompt texts of a jsonl file; formats as in :func:`treedraft.prompts.read_prompt_file`
    (``prompt``, MT-Bench ``turns``, ShareGPT ``conversations``, chat ``messages``: the first user turn)."""
    return [p.text for p in read_prompt_file(path)]


@torch.inference_mode()
def batched_greedy(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int], keep_prompt: bool = False
) -> Iterator[tuple[list[int], Tensor]]:
    """Greedy answers for a batch; yields (answer ids, hidden (len, H)) per row, in input order.

    hidden[j] is the final hidden state at the position whose lm_head chose answer[j]
    (hidden[0] = last prompt position). keep_prompt: hidden also starts with the states of the
    other prompt positions, (len(prompt) - 1 + len(answer), H) in position order (EAGLE features).
    """
    dev = target_device(model)  # inputs go where the model is
    B = len(prompts)
    L = max(len(p) for p in prompts)
    pad = [L - len(p) for p in prompts]
    toks = torch.tensor([[0] * pad[b] + list(prompts[b]) for b in range(B)], device=dev)  # (B, L)
    valid = torch.tensor([[False] * pad[b] + [True] * len(prompts[b]) for b in range(B)], device=dev)  # (B, L)
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)
    total = L + max_new_tokens
    cache = model.new_cache(total, batch=B)
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    mask = causal[None] & valid[:, None, :]  # (B, L, L)
    mask |= torch.eye(L, dtype=torch.bool, device=dev)[None]  # pad rows attend to themselves (no NaNs)
    logits, hidden = model(toks, positions, cache, 0, mask[:, None], logits_for=slice(-1, None))
    prefill_hidden = hidden if keep_prompt else None  # (B, L, H)
    cache.keep(0, range(L))
    valid_all = torch.zeros(B, total, dtype=torch.bool, device=dev)
    valid_all[:, :L] = valid
    slot_pos = torch.zeros(B, total, dtype=torch.long, device=dev)  # each cached slot's position (left padding)
    slot_pos[:, :L] = positions
    # the own runtime's sliding-window layers (Gemma 3) need the slots' positions: slot j is not position j here
    windowed = bool(getattr(getattr(model, "config", None), "local_layers", ()))
    nxt = logits[:, -1].argmax(-1)  # (B,)
    answers: list[list[int]] = [[] for _ in range(B)]
    hiddens: list[list[Tensor]] = [[hidden[b, -1]] for b in range(B)]
    done = [False] * B
    pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        for b in range(B):
            if not done[b]:
                answers[b].append(int(nxt[b]))
                if int(nxt[b]) in eos or len(answers[b]) >= max_new_tokens:
                    done[b] = True
        if all(done):
            break
        start = L + step
        valid_all[:, start] = True
        m = valid_all[:, None, None, : start + 1]  # (B, 1, 1, S)
        kw = {"kv_positions": slot_pos[:, :start]} if windowed else {}
        logits, hidden = model(nxt[:, None], pos[:, None], cache, start, m, **kw)
        slot_pos[:, start] = pos
        cache.keep(start, [0])
        nxt = logits[:, -1].argmax(-1)
        pos = pos + 1
        for b in range(B):
            if not done[b]:
                hiddens[b].append(hidden[b, -1])
    for b in range(B):
        hid = torch.stack(hiddens[b][: len(answers[b])])
        if keep_prompt:  # prompt positions 0 .. len-2 (the last one is hiddens[b][0])
            hid = torch.cat([prefill_hidden[b, pad[b] : L - 1], hid])
        yield answers[b], hid


class DataCacheMismatchError(ValueError):
    """A data directory generated with other settings than the ones asked for."""


META_FILE = "meta.json"
# meta key -> the option that sets it (for messages)
_META_FLAGS = {
    "model": "--model",
    "model_file": "--model",
    "max_new_tokens": "--max-new-tokens",
    "max_prompt_tokens": "--max-prompt-tokens",
    "prompts": "--prompts / --num-prompts",
    "num_prompts": "--num-prompts",
    "prompt_file": "--prompts",
    "prompts_sha1": "--prompts / --num-prompts",
    "temperature": "--gen-temperature",
    "seed": "--gen-seed",
}
# a key is only informative when the stronger identity in the value is known on both sides
_COVERED_BY = {"model": "model_file", "prompt_file": "prompts_sha1", "num_prompts": "prompts_sha1"}
# progress and layout, not content: a resumed run keeps the directory's shard size
_STATE_KEYS = ("complete", "shard_size")


def model_identity(llm) -> dict:
    """{"model": name} plus "model_file": "<file name>:<bytes>" when the weights can be located."""
    ident = {"model": llm.model_name}
    try:  # best effort: registry names, .gguf files and HF directories; anything else stays name-only
        from ..models.registry import resolve

        p = resolve(llm.model_name)
        size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))
        ident["model_file"] = f"{p.name}:{size}"
    except Exception:
        pass
    return ident


def dataset_meta(
    llm,
    prompts: Sequence[str],
    kept: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    shard_size: int,
    prompt_file: str | Path | None = None,
) -> dict:
    """What identifies a data directory's content (written to meta.json)."""
    h = hashlib.sha1()
    for p in prompts:
        h.update(p.encode("utf-8", "replace") + b"\0")
    meta = {
        **model_identity(llm),
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "prompts": kept,
        "num_prompts": len(prompts),
        "prompts_sha1": h.hexdigest(),
        "shard_size": shard_size,
    }
    if prompt_file is not None:
        meta["prompt_file"] = str(Path(prompt_file).resolve())
    return meta


def has_shards(d: str | Path) -> bool:
    """Whether directory ``d`` holds data shards (``shard_*.safetensors``)."""
    return any(Path(d).glob("shard_*.safetensors"))


def read_meta(d: str | Path) -> dict:
    """A data directory's ``meta.json`` ({} if there is none); DataCacheMismatchError if it cannot be read."""
    path = Path(d) / META_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataCacheMismatchError(f"{path} is unreadable ({e}); delete {d} to regenerate it") from e


def check_meta(out_dir: str | Path, meta: dict) -> dict:
    """Compare ``meta`` with ``out_dir/meta.json``; raise DataCacheMismatchError on a difference.

    Keys missing on either side are unknown and accepted (directories written before a key
    existed, or by the older code that wrote meta.json only at the end). Returns the stored meta
    ({} if none)."""
    old = read_meta(out_dir)
    diffs = []
    for k, v in meta.items():
        if k in _STATE_KEYS or k not in old or old[k] == v:
            continue
        cover = _COVERED_BY.get(k)
        if cover is not None and cover in old and cover in meta:
            continue  # the stronger identity decides
        if k == "prompts_sha1":
            diffs.append(
                f"the prompts differ ({old.get('num_prompts', '?')} prompts from "
                f"{old.get('prompt_file', 'an unrecorded file')}; now {meta.get('num_prompts', '?')} from "
                f"{meta.get('prompt_file', 'an unrecorded file')}) [{_META_FLAGS[k]}]"
            )
        else:
            diffs.append(f"{k} {old[k]!r} (now {v!r}) [{_META_FLAGS.get(k, k)}]")
    if diffs:
        raise DataCacheMismatchError(
            f"data directory {out_dir} was generated with other settings: "
            + "; ".join(diffs)
            + f". Delete {out_dir} to regenerate it, point at another data directory, or change the option in "
            "[brackets] back."
        )
    return old


def _shard_prompt_ids(path: Path) -> set[int]:
    """Prompt indices answered in a shard (reads only its ``seq`` tensor); empty if there is no shard."""
    if not path.is_file():
        return set()
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.get_tensor("seq").unique().tolist())


def _check_existing_shards(out: Path, shards: list[list[tuple[int, list[int]]]]) -> None:
    """Shards already in ``out`` must answer exactly the prompts this run puts in them."""
    stray = sorted(
        f.name for f in out.glob("shard_*.safetensors") if not f.stem[6:].isdigit() or int(f.stem[6:]) >= len(shards)
    )
    if stray:
        raise DataCacheMismatchError(
            f"{out} holds shards this run would not write ({', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''}): "
            f"it was generated from more prompts. Delete {out} to regenerate it, or point at another directory."
        )
    for si, shard in enumerate(shards):
        path = out / f"shard_{si:05d}.safetensors"
        if path.is_file():
            have, want = _shard_prompt_ids(path), {i for i, _ in shard}
            if have != want:
                raise DataCacheMismatchError(
                    f"{path} holds answers to other prompts than this run expects ({len(have)} prompts, "
                    f"{len(have - want)} not expected here): the directory was generated from another prompt list "
                    f"or --max-prompt-tokens. Delete {out} to regenerate it, or point at another directory."
                )


def encode_fitting(llm, prompts: Sequence[str], max_prompt_tokens: int) -> list[tuple[int, list[int]]]:
    """(index, ids) of the prompts whose encoding has 1..max_prompt_tokens tokens; ValueError when none fits."""
    encoded = []
    for i, p in enumerate(prompts):
        try:
            ids = llm.encode_prompt(p)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from e
        if 0 < len(ids) <= max_prompt_tokens:
            encoded.append((i, ids))
    if not encoded:
        raise ValueError(
            f"none of the {len(prompts)} prompts fits in max_prompt_tokens={max_prompt_tokens}: raise "
            "--max-prompt-tokens, or take more prompts (--num-prompts: the file's first N, in its order, before this "
            "filter; ShareGPT's file lists its longest prompts first) or other ones (--prompts)"
        )
    return encoded


def _write_meta(out: Path, meta: dict) -> None:
    from ..models.cache import atomic_write_text

    atomic_write_text(out / META_FILE, json.dumps(meta, indent=1))


def generate_dataset(
    llm,
    prompts: Sequence[str],
    out_dir: str | Path,
    max_new_tokens: int = 192,
    batch_size: int = 16,
    max_prompt_tokens: int = 384,
    shard_size: int = 64,
    progress: bool = True,
    prompt_file: str | Path | None = None,
    keep_prompt: bool = False,
) -> Path:
    """Generate (resumably) self-distillation shards for ``prompts`` into ``out_dir``.

    keep_prompt: rows also cover the prompt positions (token = the next prompt token; EAGLE's
    training sequences) and each shard gets ``answer`` (N,) int8: 1 where the token is the model's own.

    Prompts are encoded with ``llm.encode_prompt`` (chat template, or BOS + text for raw models),
    exactly as they are served. ``meta.json`` (model, prompts, token limits, shard size) is written
    before the first shard; resuming with other settings raises DataCacheMismatchError.
    """
    from tqdm import tqdm

    from ..models.cache import save_tensors

    out = Path(out_dir)
    encoded = encode_fitting(llm, prompts, max_prompt_tokens)
    meta = dataset_meta(llm, prompts, len(encoded), max_new_tokens, max_prompt_tokens, shard_size, prompt_file)
    meta["keep_prompt"] = keep_prompt
    old = check_meta(out, meta)
    # resume with the directory's own shard layout (older directories did not record it: read it off shard 0)
    shard_size = int(old.get("shard_size") or len(_shard_prompt_ids(out / "shard_00000.safetensors")) or shard_size)
    meta["shard_size"] = shard_size
    shards = [encoded[s : s + shard_size] for s in range(0, len(encoded), shard_size)]
    _check_existing_shards(out, shards)
    out.mkdir(parents=True, exist_ok=True)
    _write_meta(out, {**old, **meta, "complete": False})
    tok = llm.tokenizer
    extra = {"keep_prompt": True} if keep_prompt else {}  # the answer-only call stays as it was
    bar = tqdm(total=len(encoded), desc="self-distillation", disable=not progress, unit="prompt")
    for si, shard in enumerate(shards):
        path = out / f"shard_{si:05d}.safetensors"
        if path.is_file():  # checked by _check_existing_shards
            bar.update(len(shard))
            continue
        shard = sorted(shard, key=lambda x: len(x[1]))  # similar lengths batch together: less padding
        rows_tok, rows_hid, rows_seq, rows_prompt, rows_ans = [], [], [], [], []
        for b in range(0, len(shard), batch_size):
            batch = shard[b : b + batch_size]
            for (idx, ids), (ans, hid) in zip(
                batch,
                batched_greedy(llm.model, [x[1] for x in batch], max_new_tokens, tok.eos_token_ids, **extra),
            ):
                # tokens aligned with hidden: token j is what follows hidden j (the lm_head's choice in answers)
                head = list(ids[1:]) if keep_prompt else []
                rows_ans.append(torch.tensor([0] * len(head) + [1] * len(ans), dtype=torch.int8))
                ans = head + ans
                rows_tok.append(torch.tensor(ans, dtype=torch.int32))
                rows_hid.append(hid.to(torch.float16).cpu())
                rows_seq.append(torch.full((len(ans),), idx, dtype=torch.int32))
                rows_prompt.append(idx)
            bar.update(len(batch))
        tmp = path.with_suffix(".tmp")
        tensors = {"tokens": torch.cat(rows_tok), "hidden": torch.cat(rows_hid), "seq": torch.cat(rows_seq)}
        if keep_prompt:
            tensors["answer"] = torch.cat(rows_ans)
        save_tensors(tensors, tmp)
        tmp.replace(path)
    bar.close()
    _write_meta(out, {**old, **meta, "complete": True})
    return out


def load_shards(d: str | Path) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate all shards: tokens (N,), hidden (N, H), seq (N,).

    Shards that also hold the prompt positions (EAGLE data, ``answer`` flags: ``train-eagle``'s data directories)
    give their answer rows only: row j is then, as in the heads' own data, the hidden state that chose token j.
    """
    from safetensors.torch import load_file

    files = sorted(Path(d).glob("shard_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no shard_*.safetensors; run the data step first")
    parts = [load_file(str(f)) for f in files]
    for p in parts:
        if "answer" in p:
            keep = p.pop("answer").bool()
            for k in ("tokens", "hidden", "seq"):
                p[k] = p[k][keep]
    return (
        torch.cat([p["tokens"] for p in parts]).long(),
        torch.cat([p["hidden"] for p in parts]),
        torch.cat([p["seq"] for p in parts]).long(),
    )


def load_many_shards(dirs: Sequence[str | Path], with_offsets: bool = False) -> tuple:
    """:func:`load_shards` of several directories in order; sequence ids kept apart (directory i's ids + offset).
    ``with_offsets``: also each directory's offset and its rows."""
    toks, hids, seqs, offs, off = [], [], [], [], 0
    for d in dirs:
        t, h, s = load_shards(d)
        toks.append(t)
        hids.append(h)
        offs.append(off)
        seqs.append(s + off)
        off = int(seqs[-1].max()) + 1 if len(s) else off
    if len({h.shape[1] for h in hids}) > 1:
        raise ValueError(f"data directories {list(map(str, dirs))} hold hidden states of different sizes")
    out = (torch.cat(toks), torch.cat(hids), torch.cat(seqs))
    return (*out, offs, [len(t) for t in toks]) if with_offsets else out
