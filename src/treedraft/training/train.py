"""Medusa head training by self-distillation on cached (token, hidden) shards.

Row j of a sequence holds the hidden state whose lm_head produced token j, so
head k at row j learns token j+k+1 of the same sequence (t+2 .. t+K+1 relative
to the position itself). Loss: cross-entropy per head weighted decay**k.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..drafters.medusa import MedusaConfig, MedusaHeads
from ..models.cache import temp_sibling
from .data import load_many_shards, read_meta


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 256
    decay: float = 0.8  # per-head loss weight decay**k
    heldout_frac: float = 0.05
    seed: int = 0
    warmup_steps: int = 20
    checkpoint_every: int = 200


def head_targets(tokens: Tensor, seq: Tensor, num_heads: int) -> Tensor:
    """(N,) tokens, (N,) sequence ids -> (N, K) targets (-100 where the target crosses a sequence end)."""
    N = tokens.shape[0]
    out = torch.full((N, num_heads), -100, dtype=torch.long)
    for k in range(num_heads):
        off = k + 1
        if off >= N:
            break
        same = seq[off:] == seq[:-off]
        out[: N - off, k] = torch.where(same, tokens[off:], torch.full_like(tokens[off:], -100))
    return out


def frequency_vocab(tokens: Tensor, vocab_size: int, size: int) -> Tensor:
    """Token ids ranked by frequency in the training answers (ties: lower id first); first ``size``."""
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) * 1e-9  # deterministic tie-break
    return counts.argsort(descending=True)[:size]


def split_by_sequence(seq: Tensor, frac: float, seed: int) -> Tensor:
    """Boolean (N,) mask of held-out rows: whole sequences, chosen by a seeded permutation (at least one where ``frac``
    > 0, and never every one: a single sequence is trained on, nothing held out)."""
    ids = seq.unique()
    g = torch.Generator().manual_seed(seed)
    n_hold = min(max(1, int(round(len(ids) * frac))), len(ids) - 1) if frac > 0 else 0
    held = ids[torch.randperm(len(ids), generator=g)[:n_hold]]
    return torch.isin(seq, held)


@torch.no_grad()
def rank_hits(
    heads: MedusaHeads,
    hidden: Tensor,
    targets: Tensor,
    max_rank: int = 10,
    batch: int = 512,
    roots: Tensor | None = None,
) -> Tensor:
    """(K, max_rank) tensor: P(the target is head k's rank-r candidate), over rows whose target exists.

    Ranks are in the heads' draft vocabulary mapped back to token ids, so a target outside it is a
    miss at every rank. Ranks beyond the draft vocabulary's size have probability 0.
    roots: (N,) the token each row's lm_head chose (the tree root), for root-conditioned heads.
    """
    K = heads.config.num_heads
    hits = torch.zeros(K, max_rank)
    n = torch.zeros(K)
    vm = heads.vocab_map
    dev = next(heads.parameters()).device  # rows stored on the CPU, heads where their target is (a GPU too)
    for s in range(0, hidden.shape[0], batch):
        t = targets[s : s + batch]  # (b, K)
        root = None if roots is None else roots[s : s + batch].to(dev)
        logits = heads(hidden[s : s + batch].to(dev).float(), root)  # (b, K, V')
        r = min(max_rank, logits.shape[-1])
        top = logits.topk(r, dim=-1).indices  # (b, K, r)
        if vm is not None:
            top = vm[top]  # (a buffer: on the heads' device)
        top = top.cpu()
        ok = t >= 0
        n += ok.sum(0)
        hits[:, :r] += ((top == t[..., None]) & ok[..., None]).sum(0)
    return hits / n.clamp_min(1)[:, None]


def rank_accuracy(
    heads: MedusaHeads,
    hidden: Tensor,
    targets: Tensor,
    max_rank: int = 10,
    batch: int = 512,
    roots: Tensor | None = None,
) -> list[list[float]]:
    """acc[k][r] = P(the target is head k's rank-r candidate): the tree calibrator's input."""
    return rank_hits(heads, hidden, targets, max_rank, batch, roots).tolist()


def evaluate(
    heads: MedusaHeads,
    hidden: Tensor,
    targets: Tensor,
    ks: tuple[int, ...] = (1, 5),
    batch: int = 512,
    roots: Tensor | None = None,
) -> dict[str, list[float]]:
    """Per-head top-k accuracy (over rows whose target exists, in the full vocabulary).

    Top-k accuracy is the cumulative sum of the rank accuracies up to rank k (candidates are distinct).
    """
    cum = rank_hits(heads, hidden, targets, max(ks), batch, roots).cumsum(-1)  # (K, kmax)
    return {f"top{k}": cum[:, k - 1].tolist() for k in ks}


# MedusaConfig / TrainConfig fields that a checkpoint must agree on to be resumed
_SHAPE_KEYS = (
    "base_model",
    "hidden_size",
    "vocab_size",
    "num_heads",
    "num_layers",
    "shared_lm_head",
    "draft_vocab",
    "root_conditioned",
)
_RUN_KEYS = ("epochs", "lr", "weight_decay", "batch_size", "decay", "heldout_frac", "seed", "warmup_steps")
_FLAGS = {
    "num_heads": "--num-heads",
    "num_layers": "--num-layers",
    "shared_lm_head": "--projection",
    "draft_vocab": "--draft-vocab",
    "root_conditioned": "--root-conditioned",
    "base_model": "--model",
    "hidden_size": "--model",
    "vocab_size": "--model",
    "epochs": "--epochs",
    "lr": "--lr",
    "batch_size": "--batch-size",
    "seed": "--seed",
}


class CheckpointMismatchError(ValueError):
    """A checkpoint written for other heads, another training run or other data."""


def medusa_config_dict(mcfg: MedusaConfig) -> dict:
    """JSON-able dict of a MedusaConfig (as medusa.json stores it)."""
    d = asdict(mcfg)
    d["choices"] = [list(c) for c in mcfg.choices]
    return d


def heads_digest(heads: MedusaHeads | None) -> str | None:
    """sha1 of heads' trained tensors (which initial heads a run started from); None for fresh heads."""
    if heads is None:
        return None
    h = hashlib.sha1()
    for k, v in sorted(heads.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def hold_out_copies(held: Tensor, seq: Tensor, offsets: Sequence[int], prompt_keys: Sequence[str | None]) -> Tensor:
    """``held`` with, in every data directory made from the same prompts (``prompt_keys``: meta.json's
    ``prompts_sha1`` per directory) as another, the answers to the prompts held out in any of them held out too: their
    sequence ids are prompt indices, and train-eagle's greedy data beside a sampled copy of it would otherwise train on
    the held-out prompts (a review, session 44). ``offsets``: where each directory's ids start in ``seq``
    (:func:`load_many_shards`)."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(prompt_keys):
        if key:
            groups.setdefault(key, []).append(i)
    shared = [m for m in groups.values() if len(m) > 1]
    if not shared:
        return held
    where = torch.bucketize(seq, torch.tensor(offsets[1:], dtype=seq.dtype), right=True)  # each row's directory
    raw = seq - torch.tensor(offsets, dtype=seq.dtype)[where]  # its id within that directory: the prompt's index
    for members in shared:
        group = torch.isin(where, torch.tensor(members))
        held = held | (group & torch.isin(raw, raw[group & held].unique()))
    return held


def data_fingerprint(dirs: Sequence[str | Path], prompt_keys: Sequence[str | None], rows: Sequence[int]) -> list[list]:
    """Per training-data directory, in order: its path, its prompts' digest (meta.json) and its rows; a resume with
    the directories reordered or swapped would hold other sequences out, some trained on already."""
    return [[str(Path(d).resolve()), key, int(n)] for d, key, n in zip(dirs, prompt_keys, rows)]


def check_checkpoint(
    st: dict,
    path: Path,
    mcfg: MedusaConfig,
    tcfg: TrainConfig,
    vocab_map: Tensor | None,
    rows: int,
    init: str | None = None,
    data: list[list] | None = None,
) -> None:
    """Refuse to resume ``st`` unless it was written for the same heads, run settings and data.

    Checkpoints from before these keys were stored are accepted (unknown = no objection)."""
    diffs = []
    for name, keys, now in (
        ("medusa_config", _SHAPE_KEYS, medusa_config_dict(mcfg)),
        ("train_config", _RUN_KEYS, asdict(tcfg)),
    ):
        old = st.get(name)
        if not isinstance(old, dict):
            continue
        for k in keys:
            if k in old and old[k] != now[k]:
                diffs.append(f"{k} {old[k]!r} (now {now[k]!r})" + (f" [{_FLAGS[k]}]" if k in _FLAGS else ""))
    if st.get("init", None) != init and ("init" in st or init is not None):
        was = "fresh heads" if st.get("init") is None else "other initial heads"
        now = "fresh heads" if init is None else "these initial heads"
        diffs.append(f"started from {was} (now {now}) [--init-from]")
    if "data_rows" in st and st["data_rows"] != rows:
        diffs.append(
            f"training data rows {st['data_rows']} (now {rows}) [--train-data / --extra-train-data / --data-dir]"
        )
    elif data is not None and st.get("data_dirs") is not None and st["data_dirs"] != data:
        diffs.append(
            f"training data directories {[d[0] for d in st['data_dirs']]} (now {[d[0] for d in data]}, or their "
            "content changed) [--train-data / --extra-train-data / --data-dir]"
        )
    elif not diffs and "vocab_map" in st:
        old_vm = st["vocab_map"]
        same = (old_vm is None and vocab_map is None) or (
            old_vm is not None and vocab_map is not None and torch.equal(old_vm, vocab_map)
        )
        if not same:
            diffs.append(
                "the draft vocabulary (the training data changed) [--train-data / --extra-train-data / --data-dir]"
            )
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by another training run: "
            + "; ".join(diffs)
            + f". Delete {path} (or choose another --out) to start over, change the option in [brackets] back, or,"
            " where that run finished, train further from the heads it wrote: --init-from <its --out> --out NEW_DIR."
        )


def train_heads(
    data_dir: str | Path | Sequence[str | Path],
    lm_head_weight: Tensor,
    mcfg: MedusaConfig,
    tcfg: TrainConfig,
    out_dir: str | Path,
    progress: bool = True,
    resume: bool = True,
    embed_weight: Tensor | None = None,
    init: MedusaHeads | None = None,
) -> tuple[MedusaHeads, dict]:
    """Train heads on shards in ``data_dir`` (or several directories); checkpoints and the final heads go to
    ``out_dir``. init: start from these heads (their configuration, weights and draft vocabulary; ``mcfg`` must
    be their config)."""
    from tqdm import tqdm

    torch.manual_seed(tcfg.seed)
    if mcfg.draft_vocab < 0 or mcfg.draft_vocab > mcfg.vocab_size:
        raise ValueError(f"draft_vocab must be in 0 .. {mcfg.vocab_size} (0 = full vocabulary), got {mcfg.draft_vocab}")
    dirs = [data_dir] if isinstance(data_dir, (str, Path)) else list(data_dir)
    tokens, hidden, seq, offsets, dir_rows = load_many_shards(dirs, with_offsets=True)
    if hidden.shape[1] != mcfg.hidden_size:
        raise ValueError(f"{dirs[0]}: hidden size {hidden.shape[1]} does not match the model's {mcfg.hidden_size}")
    targets = head_targets(tokens, seq, mcfg.num_heads)
    prompt_keys = [read_meta(d).get("prompts_sha1") for d in dirs]  # what each directory was made from
    held = hold_out_copies(split_by_sequence(seq, tcfg.heldout_frac, tcfg.seed), seq, offsets, prompt_keys)
    tr_idx = (~held).nonzero().squeeze(1)
    if len(tr_idx) == 0:
        raise ValueError(
            f"no training rows: the {len(seq.unique())} answer(s) in {', '.join(map(str, dirs))} are all held out "
            "(heldout_frac); give more prompts (--num-prompts) or more data directories"
        )
    data_fp = data_fingerprint(dirs, prompt_keys, dir_rows)
    init_id = heads_digest(init)
    if init is not None:
        if replace(init.config, extra={}, choices=()) != replace(mcfg, extra={}, choices=()):
            raise ValueError("train_heads(init=...): mcfg must be the initial heads' config")
        vocab_map = None if init.vocab_map is None else init.vocab_map.clone()
    else:
        vocab_map = frequency_vocab(tokens[~held], mcfg.vocab_size, mcfg.draft_vocab) if mcfg.draft_vocab else None
    # trained where the target's weights are (a GPU when the model was loaded there); the rows stay on the CPU and
    # go over a batch at a time
    dev = lm_head_weight.device
    heads = MedusaHeads(mcfg, lm_head_weight, vocab_map, embed_weight).to(dev)
    if init is not None:
        heads.load_state_dict(init.state_dict())
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    steps_per_epoch = math.ceil(len(tr_idx) / tcfg.batch_size)
    total = steps_per_epoch * tcfg.epochs
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    step = 0
    if resume and ckpt.is_file():
        try:  # (load_state_dict moves it to the heads)
            st = torch.load(ckpt, weights_only=False, map_location="cpu")
        except Exception as e:  # torn (written before saves were atomic, or a full disk): not a traceback
            raise CheckpointMismatchError(
                f"checkpoint {ckpt} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"delete it to start over, or choose another --out"
            ) from None
        check_checkpoint(st, ckpt, mcfg, tcfg, vocab_map, len(tokens), init_id, data_fp)
        try:
            heads.load_state_dict(st["heads"])
        except RuntimeError as e:  # an old checkpoint without stored configs, for other heads
            raise CheckpointMismatchError(
                f"checkpoint {ckpt} does not fit these heads (--num-heads, --num-layers, "
                f"--projection, --draft-vocab changed?); delete it or choose another "
                f"--out. ({str(e).splitlines()[0]})"
            ) from e
        opt.load_state_dict(st["opt"])
        step = st["step"]
        if progress:
            print(f"train-heads: resuming from {ckpt} at step {step} of {total}", file=sys.stderr, flush=True)
    # remap targets into the draft vocabulary (-100 if outside it: that head cannot propose it anyway)
    if vocab_map is not None:
        inv = torch.full((mcfg.vocab_size,), -100, dtype=torch.long)
        inv[vocab_map] = torch.arange(len(vocab_map))
        tgt_local = torch.where(targets >= 0, inv[targets.clamp_min(0)], targets)
    else:
        tgt_local = targets
    wts = torch.tensor([tcfg.decay**k for k in range(mcfg.num_heads)], device=dev)
    bar = tqdm(total=total, initial=step, desc="train-heads", disable=not progress)
    heads.train()
    t0 = time.time()
    while step < total:
        epoch = step // steps_per_epoch
        perm = tr_idx[torch.randperm(len(tr_idx), generator=torch.Generator().manual_seed(tcfg.seed + epoch))]
        for b in range(step % steps_per_epoch, steps_per_epoch):
            idx = perm[b * tcfg.batch_size : (b + 1) * tcfg.batch_size]
            lr = tcfg.lr * min(1.0, (step + 1) / tcfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / total))
            for grp in opt.param_groups:
                grp["lr"] = lr
            logits = heads(hidden[idx].to(dev).float(), tokens[idx].to(dev))  # (b, K, V'); row j's root is token j
            t = tgt_local[idx].to(dev)  # (b, K)
            losses = torch.stack(
                [F.cross_entropy(logits[:, k], t[:, k], ignore_index=-100) for k in range(mcfg.num_heads)]
            )
            losses = torch.nan_to_num(losses)
            loss = (losses * wts).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            with torch.no_grad():
                acc = [
                    ((logits[:, k].argmax(-1) == t[:, k]) & (t[:, k] >= 0)).sum().item()
                    / max(1, (t[:, k] >= 0).sum().item())
                    for k in range(mcfg.num_heads)
                ]
            bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in acc))
            bar.update(1)
            if step % tcfg.checkpoint_every == 0 or step == total:
                tmp = temp_sibling(ckpt)  # written whole, then renamed: an interrupt keeps the last one
                torch.save(
                    {
                        "heads": heads.state_dict(),
                        "opt": opt.state_dict(),
                        "step": step,
                        "medusa_config": medusa_config_dict(mcfg),
                        "train_config": asdict(tcfg),
                        "vocab_map": vocab_map,
                        "data_rows": len(tokens),
                        "data_dirs": data_fp,
                        "init": init_id,
                    },
                    tmp,
                )
                os.replace(tmp, ckpt)
            if step >= total:
                break
    bar.close()
    heads.eval()
    held_idx = held.nonzero().squeeze(1)
    report = {
        "train_rows": len(tr_idx),
        "heldout_rows": len(held_idx),
        "epochs": tcfg.epochs,
        "seconds": round(time.time() - t0, 1),
        "heldout": evaluate(heads, hidden[held_idx], targets[held_idx], roots=tokens[held_idx])
        if len(held_idx)
        else {},
    }
    if init is not None:  # the initial heads' own split is unknown: they may have trained on these rows
        report["heldout_note"] = "started from trained heads: the held-out rows may have been trained on before"
    heads.requires_grad_(False)
    heads.config = replace(mcfg, extra={**mcfg.extra, "training": report})
    return heads, report
