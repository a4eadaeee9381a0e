"""One native EAGLE draft call vs one target forward, interleaved in one process (medians, ms).

python benchmarks/eagle_draft_call.py [--weights int4] [--reps 30] [--context 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import treedraft


def main() -> None:
    """Print one JSON line: target forward (1/2/4 rows) and draft call (1/4 rows) medians in ms."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--context", type=int, default=256)
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=a.weights)
    m, d = llm.model, llm.get_drafter("eagle")
    if d.native is None:
        raise SystemExit("the eagle drafter has no native draft step on this target")
    ctx = a.context
    g = torch.Generator().manual_seed(0)
    cache = m.new_cache(ctx + 8)
    with torch.inference_mode():
        _, hid = m.forward(torch.randint(0, m.vocab_size, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        cache.keep(0, range(ctx))
        dc = d.net.new_cache(ctx + 8)
        feats = hid[0].contiguous()
        toks = torch.randint(0, m.vocab_size, (ctx,), generator=g)
        d.native(feats, toks, torch.arange(ctx), dc, 0, None, torch.tensor([ctx - 1]))
        times: dict[str, list[float]] = {k: [] for k in ("target_1", "target_2", "target_4", "draft_1", "draft_4")}

        def target(n: int) -> None:
            mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(ctx) if n > 1 else None
            m.forward(torch.randint(0, m.vocab_size, (1, n), generator=g), torch.arange(ctx, ctx + n), cache, ctx, mask)

        def draft(n: int) -> None:
            mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(ctx) if n > 1 else None
            rows = torch.tensor([n - 1]) if n == 1 else None
            d.native(feats[-n:].contiguous(), toks[-n:], torch.arange(ctx, ctx + n), dc, ctx, mask, rows)

        for _ in range(a.reps):
            for name, fn, n in (
                ("target_1", target, 1),
                ("draft_1", draft, 1),
                ("target_2", target, 2),
                ("draft_4", draft, 4),
                ("target_4", target, 4),
            ):
                t = time.perf_counter()
                fn(n)
                times[name].append(time.perf_counter() - t)
    out = {k: round(1000 * statistics.median(v), 3) for k, v in times.items()}
    out["draft_1_over_target_1"] = round(out["draft_1"] / out["target_1"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
