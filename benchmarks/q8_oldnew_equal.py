"""Old kernels (a baseline build, old Q8_0 layout) vs this tree on the real lm_head: bitwise equal per path and rows.

The bundled model's Q8_0 lm_head is repacked into the pre-kern6 layout (byte 2c+j of qs[p] = q[c][2p+j]) for
the baseline extension (built from --baseline, e.g. ``git archive 2952897 src/treedraft/kernels | tar -x -C
/tmp/base``; see mm_ab.py) and both multiply the same activations on every code path.

    python benchmarks/q8_oldnew_equal.py --baseline /tmp/base/src/treedraft/kernels
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from mm_ab import load_baseline  # benchmarks/ is on sys.path when run as a script

import treedraft
import treedraft.kernels as tk


def old_layout(pw: tk.PackedWeight) -> torch.Tensor:
    """The packed bytes of a Q8_0 weight in the old layout (same fp16 scales)."""
    T, B = -(-pw.N // tk.TILE), pw.K // tk.QK
    blocks = pw.data.view(T, B, 544)
    q = blocks[:, :, :512].reshape(T, B, 8, 16, 4).permute(0, 1, 3, 2, 4).reshape(T, B, 16, 32)  # (T, B, c, k)
    old = q.reshape(T, B, 16, 16, 2).permute(0, 1, 3, 2, 4).reshape(T, B, 512)  # (p, c, j): k = 2p + j
    return torch.cat([old, blocks[:, :, 512:]], dim=2).reshape(-1).contiguous()


def main() -> None:
    """Compare old and new builds on the lm_head and print one line per (path, rows)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="kernel source dir or built .so")
    ap.add_argument("--rows", default="1,3,16")
    a = ap.parse_args()
    base = load_baseline(a.baseline, tk.get_num_threads())
    llm = treedraft.load(drafter=None, weights="int4")
    q8 = [
        m.packed
        for m in llm.model.modules()
        if isinstance(getattr(m, "packed", None), tk.PackedWeight) and m.packed.kind == tk.Q8_0
    ]
    if not q8:
        raise SystemExit("no Q8_0 weight in the loaded model")
    pw = q8[0]
    old = old_layout(pw)
    X = torch.randn(16, pw.K, generator=torch.Generator().manual_seed(0)) * 3
    ok = True
    for path in tk.paths():
        for M in (int(r) for r in a.rows.split(",")):
            x = X[:M].contiguous()
            same = torch.equal(base.mm(x, old, pw.N, tk.Q8_0, path), tk.mm(x, pw, path=path))
            ok &= same
            print(f"{path} rows={M} ({pw.N} x {pw.K}): bitwise equal {same}")
    print("all equal" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
