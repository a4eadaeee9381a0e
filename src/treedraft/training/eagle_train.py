"""Training the EAGLE drafter (drafters/eagle.py) on self-distillation shards (training/data.py).

Data: shards made with ``keep_prompt=True``: row j of a sequence holds the target's final-norm hidden
state f_j and the token x_{j+1} that followed it (prompt and answer positions). The draft layer reads
the pair (f_j, x_{j+1}) and predicts f_{j+1}.

Loss (EAGLE-1, Li et al. 2024): smooth-L1 regression of f_{j+1} + ``ce_weight`` x cross-entropy of
the draft distribution against the target's distribution softmax(lm_head(f_{j+1})), both over the
draft vocabulary. ``unroll`` > 1 adds passes that feed the layer its own predicted features, as
drafting does at depth > 1 (training-time test, EAGLE-3, arXiv:2503.01840): in pass k, row j reads
f^_j from pass k-1 and attends to the true pairs before j-k+1, the drafted pairs of its own chain and
itself, exactly the draft cache at tree depth k+1. Per-depth top-1 (depth k+1 = pass k, against the
target's greedy token) is measured on a held-out split after every epoch.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..drafters.eagle import EagleConfig, EagleNet
from ..models.llama import apply_rope


@dataclass(frozen=True)
class EagleTrainConfig:
    """Optimisation settings (all recorded in the checkpoint and the shipped config)."""

    epochs: int = 2
    lr: float = 3e-4
    tokens_per_batch: int = 4096
    ce_weight: float = 0.1
    unroll: int = 2  # passes per batch (1 = teacher-forced EAGLE-1 only)
    eval_unroll: int = 4  # depths measured on the held-out split
    heldout: float = 0.03  # fraction of sequences held out
    warmup: int = 20
    seed: int = 0
    ckpt_every: int = 50  # optimizer steps between checkpoints


def load_eagle_shards(d: str | Path, max_shards: int | None = None) -> dict[str, Tensor]:
    """tokens (N,) int64, hidden (N, H) fp16, seq (N,) int64, answer (N,) bool from ``d``'s shards
    (the first ``max_shards`` of them, which must all be there, when given)."""
    from safetensors.torch import load_file

    files = sorted(Path(d).glob("shard_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no shard_*.safetensors; generate the data first (treedraft train-eagle)")
    if max_shards is not None:
        want = [Path(d) / f"shard_{i:05d}.safetensors" for i in range(max_shards)]
        missing = [p.name for p in want if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{d} lacks {len(missing)} of the first {max_shards} shards ({missing[0]}, ...): "
                "generate them first or lower --max-shards"
            )
        files = want
    parts = [load_file(str(f)) for f in files]
    if any("answer" not in p for p in parts):
        raise ValueError(
            f"{d} holds answer-only shards (Medusa data); EAGLE needs prompt positions too: "
            "generate them with train-eagle (keep_prompt=True) into another directory"
        )
    return {
        "tokens": torch.cat([p["tokens"] for p in parts]).long(),
        "hidden": torch.cat([p["hidden"] for p in parts]),
        "seq": torch.cat([p["seq"] for p in parts]).long(),
        "answer": torch.cat([p["answer"] for p in parts]).bool(),
    }


def sequence_spans(seq: Tensor) -> list[tuple[int, int]]:
    """[start, end) row ranges of consecutive equal ``seq`` ids."""
    change = torch.nonzero(seq[1:] != seq[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), len(seq)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b - a >= 2]


def split_spans(spans: list[tuple[int, int]], heldout: float) -> tuple[list, list]:
    """Deterministic train / held-out split: every k-th sequence is held out."""
    if heldout <= 0:
        return spans, []
    k = max(2, round(1 / heldout))
    return [s for i, s in enumerate(spans) if i % k != k - 1], [s for i, s in enumerate(spans) if i % k == k - 1]


def make_batches(spans: list[tuple[int, int]], tokens_per_batch: int) -> list[list[tuple[int, int]]]:
    """Group sequences of similar length so a batch holds about ``tokens_per_batch`` padded rows."""
    out, cur, longest = [], [], 0
    for s in sorted(spans, key=lambda s: s[1] - s[0]):
        n = s[1] - s[0]
        if cur and max(longest, n) * (len(cur) + 1) > tokens_per_batch:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def to_device(b: dict[str, Tensor], dev: torch.device) -> dict[str, Tensor]:
    """A batch (collate's) on the net's device."""
    return {k: v.to(dev) for k, v in b.items()}


def collate(data: dict[str, Tensor], batch: list[tuple[int, int]]) -> dict[str, Tensor]:
    """Right-padded (B, T) tensors of one batch; ``valid`` marks rows j that have a target f_{j+1}."""
    T = max(b - a for a, b in batch)
    B, H = len(batch), data["hidden"].shape[1]
    feat = torch.zeros(B, T, H)
    tok = torch.zeros(B, T, dtype=torch.long)
    ans = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i, (a, b) in enumerate(batch):
        n = b - a
        feat[i, :n] = data["hidden"][a:b].float()
        tok[i, :n] = data["tokens"][a:b]
        ans[i, :n] = data["answer"][a:b]
        valid[i, : n - 1] = True
    # targets of row j: f_{j+1} and the token after it (the target's greedy choice where ans[j+1])
    tgt = torch.cat([feat[:, 1:], torch.zeros(B, 1, H)], 1)
    nxt = torch.cat([tok[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)
    nxt_ans = torch.cat([ans[:, 1:], torch.zeros(B, 1, dtype=torch.bool)], 1) & valid
    return {"feat": feat, "tok": tok, "tgt": tgt, "next": nxt, "next_is_answer": nxt_ans, "valid": valid}


def unroll_mask(T: int, k: int) -> Tensor:
    """(T, (k+1)T) bool: pass k row j sees pass-0 rows <= j-k and, for m = 1..k, pass-m row j-(k-m)."""
    j = torch.arange(T)
    m = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
    m[:, :T] = j[None, :] <= (j[:, None] - k)
    for p in range(1, k + 1):
        col = j - (k - p)
        ok = col >= 0
        m[j[ok], p * T + col[ok]] = True
    return m


def unrolled_forward(
    net: EagleNet, feat: Tensor, tok: Tensor, passes: int, blocks: Sequence | None = None
) -> list[Tensor]:
    """Predicted f_{j+1} (B, T, H) for each pass; pass k > 0 reads pass k-1's prediction of f_j.

    blocks: the decoder layers to run in order (default: the drafter's one layer; more for experiments with a
    deeper draft), each attending to its own keys/values of every earlier pass."""
    blocks = [net.layer] if blocks is None else list(blocks)
    B, T, _ = feat.shape
    pos = torch.arange(T, device=feat.device)
    ang = pos[:, None].float() * net.inv_freq
    ang = torch.cat((ang, ang), -1)[None, None]  # (1, 1, T, hd)
    cos, sin = ang.cos(), ang.sin()
    e = net.embed_weight[tok].float()
    kv: list[tuple[list[Tensor], list[Tensor]]] = [([], []) for _ in blocks]
    outs = []
    inp = feat
    for k in range(passes):
        x = net.fc(torch.cat([net.emb_norm(e), net.feat_norm(inp)], -1))
        mask = unroll_mask(T, k).to(feat.device)
        for blk, (ks, vs) in zip(blocks, kv):
            at = blk.attn
            q_out, kv_out = at.nh * at.hd, at.nkv * at.hd
            q, kk, v = at.wqkv(blk.attn_norm(x)).split((q_out, kv_out, kv_out), -1)
            q = apply_rope(q.view(B, T, at.nh, at.hd).transpose(1, 2), cos, sin)
            ks.append(apply_rope(kk.view(B, T, at.nkv, at.hd).transpose(1, 2), cos, sin))
            vs.append(v.view(B, T, at.nkv, at.hd).transpose(1, 2))
            y = F.scaled_dot_product_attention(
                q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask, enable_gqa=at.nkv != at.nh
            )
            x = x + at.wo(y.transpose(1, 2).reshape(B, T, q_out))
            x = x + blk.ffn(blk.ffn_norm(x))
        outs.append(x)
        inp = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)  # row j reads the prediction of f_j
    return outs


def batch_loss(
    net: EagleNet, b: dict[str, Tensor], passes: int, ce_weight: float, blocks: Sequence | None = None
) -> tuple[Tensor, dict]:
    """Mean over passes of smooth-L1(f^, f) + ce_weight * CE(draft || target) on valid rows; and stats."""
    outs = unrolled_forward(net, b["feat"], b["tok"], passes, blocks)
    with torch.no_grad():
        target_p = torch.softmax(net.logits(b["tgt"]), -1)  # (B, T, V')
    total, stats = 0.0, {}
    for k, out in enumerate(outs):
        valid = b["valid"].clone()
        valid[:, :k] = False  # pass k needs k earlier rows of its chain
        n = valid.sum().clamp_min(1)
        reg = (F.smooth_l1_loss(out, b["tgt"], reduction="none").mean(-1) * valid).sum() / n
        lp = torch.log_softmax(net.logits(out), -1)
        ce = (-(target_p * lp).sum(-1) * valid).sum() / n
        total = total + reg + ce_weight * ce
        stats[f"reg{k + 1}"], stats[f"ce{k + 1}"] = float(reg.detach()), float(ce.detach())
    return total / len(outs), stats


@torch.no_grad()
def evaluate(
    net: EagleNet,
    data: dict[str, Tensor],
    spans: list,
    passes: int,
    tokens_per_batch: int,
    batch_fn: Callable[[dict[str, Tensor], list], dict[str, Tensor]] | None = None,
    blocks: Sequence | None = None,
) -> list[float]:
    """Per-depth top-1 on answer rows: depth k+1 = pass k's argmax equals the target's greedy token.

    batch_fn: builds a batch from (data, spans) in collate's place (e.g. with extra input features)."""
    hit, tot = [0] * passes, [0] * passes
    vm = net.vocab_map
    for batch in make_batches(spans, tokens_per_batch):
        b = to_device((batch_fn or collate)(data, batch), net.embed_weight.device)
        for k, out in enumerate(unrolled_forward(net, b["feat"], b["tok"], passes, blocks)):
            pred = net.logits(out).argmax(-1)
            pred = pred if vm is None else vm[pred]
            ok = b["next_is_answer"].clone()
            ok[:, :k] = False
            hit[k] += int(((pred == b["next"]) & ok).sum())
            tot[k] += int(ok.sum())
    return [h / max(1, t) for h, t in zip(hit, tot)]


def frequency_vocab(tokens: Tensor, vocab_size: int) -> Tensor:
    """All token ids, most frequent in ``tokens`` first (ties by id)."""
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    return torch.sort(-counts + torch.arange(vocab_size) * 1e-9, stable=True).indices


def key_diffs(old: object, new: object, at: str = "") -> list[str]:
    """What differs between a checkpoint's run key and this run's: ``name was -> now`` per leaf (nested dicts walked;
    a training setting's name is its --flag's without the dashes)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += key_diffs(old.get(k), new.get(k), k if not at or at in ("cfg", "tcfg") else f"{at}.{k}")
        return out
    return [] if old == new else [f"{at or 'key'} {old!r} -> {new!r}"]


def train_eagle(
    data_dir: str | Path,
    target,
    cfg: EagleConfig,
    tcfg: EagleTrainConfig,
    ckpt_dir: str | Path,
    init_from_target: bool = False,
    progress: bool = True,
    init_from: str | Path | None = None,
    max_shards: int | None = None,
    extra_data: Sequence[str | Path] = (),
) -> tuple[EagleNet, dict]:
    """Train (resumably, from ``ckpt_dir``) an EAGLE drafter for ``target``; returns it and a report.

    init_from: start from the weights of an earlier drafter directory (e.g. trained on part of the data).
    extra_data: more shard directories over the same prompt file (e.g. sampled answers), for training only: the
    held-out split is ``data_dir``'s, and their answers to its held-out prompts are left out (the held-out figure
    stays one on prompts never trained on). The draft vocabulary is counted on ``data_dir`` alone."""
    from tqdm import tqdm

    torch.manual_seed(tcfg.seed)
    data = load_eagle_shards(data_dir, max_shards)
    H = data["hidden"].shape[1]
    if H != cfg.hidden_size:
        raise ValueError(f"{data_dir} holds hidden size {H} but the target has {cfg.hidden_size}: other model's data")
    vm = frequency_vocab(data["tokens"], cfg.vocab_size) if cfg.draft_vocab else None
    train_spans, held = split_spans(sequence_spans(data["seq"]), tcfg.heldout)
    held_ids = {int(data["seq"][a]) for a, _ in held}
    for d in extra_data:
        more = load_eagle_shards(d)
        if more["hidden"].shape[1] != H:
            raise ValueError(f"{d} holds hidden size {more['hidden'].shape[1]}, {data_dir} {H}: other model's data")
        base = len(data["seq"])
        train_spans += [
            (a + base, b + base) for a, b in sequence_spans(more["seq"]) if int(more["seq"][a]) not in held_ids
        ]
        data = {k: torch.cat([data[k], more[k]]) for k in data}
    net = EagleNet(cfg, target.input_embedding_weight(), target.output_projection_weight(), vm)
    init_weights(net, target if init_from_target else None)
    if init_from is not None:  # through EagleNet.load's checks: a drafter of another model is refused by name
        from ..drafters.eagle_net import EagleMismatchError

        start = EagleNet.load(init_from, target, cfg.base_model or None)
        sd = {k: v.float() for k, v in start.state_dict().items()}  # (the buffers, vocab map included, are not in it)
        try:
            net.load_state_dict(sd)
        except RuntimeError as e:
            raise EagleMismatchError(
                f"--init-from {init_from}: its drafter has another shape than the one to train "
                f"({str(e).splitlines()[-1].strip()}); give one trained with the same --draft-vocab, or none"
            ) from None
    # trained where the target's weights are (a GPU when the model was loaded there; the net's embedding and
    # lm_head buffers are the target's own), batches built on the CPU and moved over one at a time
    dev = net.embed_weight.device
    net.to(dev)
    batches = make_batches(train_spans, tcfg.tokens_per_batch)
    opt = torch.optim.AdamW(net.parameters(), lr=tcfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = tcfg.epochs * len(batches)

    def lr_at(step: int) -> float:
        if step < tcfg.warmup:
            return tcfg.lr * (step + 1) / tcfg.warmup
        return tcfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))

    ckpt_dir = Path(ckpt_dir)
    ck = ckpt_dir / "eagle_ckpt.pt"
    key = {"cfg": asdict(cfg), "tcfg": asdict(tcfg), "rows": int(len(data["seq"])), "init_from": str(init_from)}
    if extra_data:
        key["extra_data"] = [str(d) for d in extra_data]
    step, report = 0, {"epochs": [], "train_rows": sum(b - a for a, b in train_spans), "heldout_sequences": len(held)}
    if ck.is_file():
        st = torch.load(ck, weights_only=False, map_location="cpu")  # a GPU run resumes anywhere; moved on load
        if st["key"] != key:
            changed = "; ".join(key_diffs(st["key"], key)) or "?"
            raise ValueError(
                f"{ck} was written for other settings or data ({changed}); run with those again to resume, delete "
                f"{ckpt_dir} to start over, or, where that run finished, train further from the drafter it wrote: "
                f"--init-from {ckpt_dir.parent} --out NEW_DIR"
            )
        net.load_state_dict(st["net"])
        opt.load_state_dict(st["opt"])
        step, report = st["step"], st["report"]

    def save() -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = ck.with_suffix(".tmp")
        torch.save({"key": key, "net": net.state_dict(), "opt": opt.state_dict(), "step": step, "report": report}, tmp)
        tmp.replace(ck)

    bar = tqdm(total=total_steps, initial=step, desc="train-eagle", disable=not progress, unit="batch")
    t0 = time.perf_counter()
    while step < total_steps:
        epoch, i = divmod(step, len(batches))
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(tcfg.seed + epoch)).tolist()
        net.train()
        for bi in order[i:]:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, stats = batch_loss(net, to_device(collate(data, batches[bi]), dev), tcfg.unroll, tcfg.ce_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            step += 1
            bar.update(1)
            loss = loss.detach()  # (a float of it with its graph warned)
            bar.set_postfix(loss=f"{float(loss):.3f}", ce1=f"{stats['ce1']:.2f}")
            if step % tcfg.ckpt_every == 0 and step % len(batches):  # (an epoch's end is saved with its evaluation:
                save()  # saved before it, an interrupted evaluation resumed into the next epoch and lost this one's)
        net.eval()
        acc = evaluate(net, data, held, tcfg.eval_unroll, tcfg.tokens_per_batch) if held else []
        report["epochs"].append({"epoch": epoch + 1, "loss": float(loss), **stats, "heldout_top1": acc})
        held_out = f"held-out top-1 per depth {[round(a, 3) for a in acc]}" if held else "nothing held out (--heldout)"
        bar.write(f"epoch {epoch + 1}: loss {float(loss):.4f}, {held_out}")
        save()
    bar.close()
    report["train_seconds_this_run"] = round(time.perf_counter() - t0, 1)
    return net.eval().requires_grad_(False), report


def init_weights(net: EagleNet, target=None) -> None:
    """fc starts as the sum of the normalised token embedding and feature ([I | I]); the layer as the
    target's last decoder layer when ``target`` is given (float weights only)."""
    H = net.config.hidden_size
    with torch.no_grad():
        net.fc.weight.zero_()
        net.fc.weight[:, :H].copy_(torch.eye(H))
        net.fc.weight[:, H:].copy_(torch.eye(H))
        net.fc.bias.zero_()
        if target is not None:
            cfg = getattr(target, "config", None)
            if cfg is not None and not getattr(cfg, "llama_layers", True):
                raise ValueError(
                    "--init-from-target copies the target's last layer into the draft layer, a Llama layer; this "
                    "target's layers are not (Qwen3's q/k norms; Gemma 3's, its sandwich norms, a GELU gate): leave the "
                    "flag out"
                )
            src = target.layers[-1].state_dict()
            bad = [k for k, v in net.layer.state_dict().items() if k not in src or src[k].shape != v.shape]
            if bad:
                raise ValueError(
                    f"cannot initialise from the target's last layer (no float weights for {bad[:3]}): load the "
                    "target with --weights fp32 for --init-from-target"
                )
            net.layer.load_state_dict({k: src[k].float() for k in net.layer.state_dict()})


def write_report(out: Path, report: dict) -> None:
    """training.json next to the shipped drafter."""
    (out / "training.json").write_text(json.dumps(report, indent=1))
