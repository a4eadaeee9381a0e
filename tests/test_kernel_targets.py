"""The native kernels built for another CPU target than this one (TREEDRAFT_KERNEL_MARCH): an AVX2-only build
(x86-64-v3: what a Zen 3 EPYC or an AVX2-only Intel CPU compiles for itself) measured and checked on an AVX-512
machine. Every code path claims the same bits, so the AVX2 build's logits must equal the native build's bitwise
(a prefill, a 4-row tree and 1-, 2- and 3-row steps over it, the real model, int4), and speculative decoding must
stay equal to plain decoding on it. Extended: each child process builds its kernels once (about two minutes).
Both load with float32 attention scores: bf16 scores (the default 'auto' picks them on AVX512-BF16 CPUs) run the
vdpbf16ps instruction, which an AVX2 build does not have (the AVX2 and scalar paths' emulation of it is checked
bitwise within one build, tests/test_attention.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.extended]

CHILD = r"""
import json, sys, torch, treedraft
from treedraft import kernels
from treedraft.engine import GenerationConfig, GenerationStats
from treedraft.tree import TokenTree, full_attention_mask, tree_positions
out_dir = sys.argv[1]
llm = treedraft.load(drafter=None, weights="int4", attn_scores="float32")
m = llm.model
ids = torch.tensor(llm.encode_prompt("Write a short poem about the sea, then explain its meter."))
n = int(ids.shape[0])
with torch.inference_mode():
    cache = m.new_cache(max_len=n + 8)
    pre, _ = m(ids[None], torch.arange(n), cache, start=0)
    cache.keep(0, range(n))
    tree = TokenTree((11, 12, 13, 14), (-1, 0, 0, 1))  # root, two children of it, a grandchild
    tl, _ = m(torch.tensor(tree.tokens)[None], tree_positions(tree, n), cache, start=n, mask=full_attention_mask(tree, n))
    chains = {}
    for k in (1, 2, 3):  # 1-, 2- and 3-row steps: the tiles' RB = 1..3 code (a chain: causal, no mask)
        chains[k], _ = m(torch.arange(21, 21 + k)[None], n + torch.arange(k), cache, start=n)
torch.save({"prefill": pre, "tree": tl, **{f"chain{k}": v for k, v in chains.items()}}, out_dir + "/logits.pt")
plain, spec, spec_steps = [], [], 0
for prompt in ("Name three rivers in Europe and describe each.", "Repeat after me: the cat sat on the mat, twice."):
    p = llm.encode_prompt(prompt)
    cfg = GenerationConfig(max_new_tokens=40)
    with torch.inference_mode():
        # decode yields each step's committed tokens: compare the flattened sequences
        plain.append([t for step in llm.engine.decode(p, cfg, None, GenerationStats()) for t in step])
        steps = list(llm.engine.decode(p, cfg, llm.get_drafter("prompt-lookup"), GenerationStats()))
        spec.append([t for step in steps for t in step])
        spec_steps += len(steps)
print(json.dumps({"path": kernels.paths()[0], "plain": plain, "spec": spec, "spec_steps": spec_steps}))
"""


def _run(tmp: Path, march: str | None) -> dict:
    env = dict(os.environ)
    env.pop("TREEDRAFT_KERNEL_MARCH", None)
    if march:
        env["TREEDRAFT_KERNEL_MARCH"] = march
    tmp.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp)], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["logits"] = torch.load(tmp / "logits.pt")
    return res


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU flags from /proc/cpuinfo")
def test_avx2_build_gives_the_native_builds_bits_and_spec_equals_plain(tmp_path: Path) -> None:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    if "avx512f" not in flags.split() or "avx2" not in flags.split():
        pytest.skip("needs an AVX-512 CPU (the AVX2 build is then another target than this CPU's own)")
    from treedraft import kernels

    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    native = _run(tmp_path / "native", None)
    avx2 = _run(tmp_path / "avx2", "x86-64-v3")
    assert native["path"].startswith("avx512") and avx2["path"] == "avx2", (native["path"], avx2["path"])
    for part in ("prefill", "tree", "chain1", "chain2", "chain3"):
        assert torch.equal(native["logits"][part], avx2["logits"][part]), part
    assert avx2["spec"] == avx2["plain"]
    assert avx2["plain"] == native["plain"]
    assert sum(len(t) for t in avx2["plain"]) == 80  # both prompts decoded their 40 tokens
    assert avx2["spec_steps"] < 80  # and drafts were accepted: the trees took part
