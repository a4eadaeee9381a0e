"""Self-distillation data: the frozen base model answers prompts; we keep its tokens and hidden states.

Answers are generated greedily in left-padded batches through the own runtime
(one forward per step for the whole batch) and written as resumable shards:
``shard_XXXXX.safetensors`` with ``tokens`` (N,) int32, ``hidden`` (N, H) fp16 and
``seq`` (N,) int32 (sequence index, so targets never cross sequences). Only
answer positions are kept (plus the last prompt position, which predicts the
first answer token).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from jsonl: {"prompt"}, {"turns": [...]} (MT-Bench) or {"conversations"/"messages"}."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
            if isinstance(r.get("prompt"), str):
                out.append(r["prompt"])
            elif isinstance(r.get("turns"), list) and r["turns"]:
                out.append(r["turns"][0])
            else:
                raise ValueError(f"{path}:{n}: expected a 'prompt' string or a 'turns' list")
    if not out:
        raise ValueError(f"{path}: no prompts found")
    return out


@torch.inference_mode()
def batched_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int]
                   ) -> Iterator[tuple[list[int], Tensor]]:
    """Greedy answers for a batch; yields (answer ids, hidden (1+len, H)) per row, in input order.

    hidden[j] is the final hidden state at the position whose lm_head chose answer[j]
    (hidden[0] = last prompt position).
    """
    B = len(prompts)
    L = max(len(p) for p in prompts)
    pad = [L - len(p) for p in prompts]
    toks = torch.tensor([[0] * pad[b] + list(prompts[b]) for b in range(B)])  # (B, L)
    valid = torch.tensor([[False] * pad[b] + [True] * len(prompts[b]) for b in range(B)])  # (B, L)
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)  # (B, L)
    total = L + max_new_tokens
    cache = model.new_cache(total, batch=B)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = causal[None] & valid[:, None, :]  # (B, L, L)
    mask |= torch.eye(L, dtype=torch.bool)[None]  # pad rows attend to themselves (no NaNs)
    logits, hidden = model(toks, positions, cache, 0, mask[:, None], logits_for=slice(-1, None))
    cache.keep(0, range(L))
    valid_all = torch.zeros(B, total, dtype=torch.bool)
    valid_all[:, :L] = valid
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
        logits, hidden = model(nxt[:, None], pos[:, None], cache, start, m)
        cache.keep(start, [0])
        nxt = logits[:, -1].argmax(-1)
        pos = pos + 1
        for b in range(B):
            if not done[b]:
                hiddens[b].append(hidden[b, -1])
    for b in range(B):
        yield answers[b], torch.stack(hiddens[b][: len(answers[b])])


def generate_dataset(llm, prompts: Sequence[str], out_dir: str | Path, max_new_tokens: int = 192,
                     batch_size: int = 16, max_prompt_tokens: int = 384, shard_size: int = 64,
                     progress: bool = True) -> Path:
    """Generate (resumably) self-distillation shards for ``prompts`` into ``out_dir``."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = llm.tokenizer
    encoded = []
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p}]) if tok.is_chat else tok.encode(p)
        if 0 < len(ids) <= max_prompt_tokens:
            encoded.append((i, ids))
    shards = [encoded[s : s + shard_size] for s in range(0, len(encoded), shard_size)]
    bar = tqdm(total=len(encoded), desc="self-distillation", disable=not progress, unit="prompt")
    for si, shard in enumerate(shards):
        path = out / f"shard_{si:05d}.safetensors"
        if path.is_file():
            bar.update(len(shard))
            continue
        shard = sorted(shard, key=lambda x: len(x[1]))  # similar lengths batch together: less padding
        rows_tok, rows_hid, rows_seq, rows_prompt = [], [], [], []
        for b in range(0, len(shard), batch_size):
            batch = shard[b : b + batch_size]
            for (idx, ids), (ans, hid) in zip(batch, batched_greedy(llm.model, [x[1] for x in batch],
                                                                    max_new_tokens, tok.eos_token_ids)):
                # tokens aligned with hidden: token j is what the lm_head chose from hidden j
                rows_tok.append(torch.tensor(ans, dtype=torch.int32))
                rows_hid.append(hid.to(torch.float16))
                rows_seq.append(torch.full((len(ans),), idx, dtype=torch.int32))
                rows_prompt.append(idx)
            bar.update(len(batch))
        tmp = path.with_suffix(".tmp")
        save_file({"tokens": torch.cat(rows_tok), "hidden": torch.cat(rows_hid), "seq": torch.cat(rows_seq)},
                  str(tmp))
        tmp.replace(path)
    bar.close()
    (out / "meta.json").write_text(json.dumps({"model": llm.model_name, "prompts": len(encoded),
                                               "max_new_tokens": max_new_tokens}))
    return out


def load_shards(d: str | Path) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate all shards: tokens (N,), hidden (N, H), seq (N,)."""
    from safetensors.torch import load_file

    files = sorted(Path(d).glob("shard_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no shard_*.safetensors; run the data step first")
    parts = [load_file(str(f)) for f in files]
    return (torch.cat([p["tokens"] for p in parts]).long(), torch.cat([p["hidden"] for p in parts]),
            torch.cat([p["seq"] for p in parts]).long())
