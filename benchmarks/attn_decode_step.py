"""Decode-step latency at a 512-token cache: SDPA vs native attend (real model, int4 forced-native linears).

Run: PYTHONPATH=src python benchmarks/attn_decode_step.py  (prints medians of 7 interleaved reps x 5 steps)
"""

import statistics
import time

import torch

import treedraft
from treedraft.models import quant_load

key = quant_load._machine_key
quant_load._machine_key = lambda path, extra: key(path, extra + "|test-native")
quant_load.choose_kernels = lambda qw, natives, log=None: {"q4": "native", "q8": "native"}
llm = treedraft.load(weights="int4", drafter=None)
m = llm.model
assert m.exact_attention
P = 512
cache = m.new_cache(max_len=P + 64)
ids = torch.randint(0, 1000, (P,))
with torch.inference_mode():
    m(ids[None], torch.arange(P), cache, start=0)
    res = {}
    for _rep in range(7):
        for exact in (False, True):
            m.exact_attention = exact
            for T in (1, 16):
                toks = torch.randint(0, 1000, (1, T))
                t0 = time.perf_counter()
                for _ in range(5):
                    m(toks, torch.arange(P, P + T), cache, start=P)
                res.setdefault((exact, T), []).append((time.perf_counter() - t0) / 5 * 1e3)
    # attention alone: one layer's shapes
    q = torch.randn(16, 9, 64)
    k, v = cache.k[0][0, :, : P + 16], cache.v[0][0, :, : P + 16]
    mask = torch.ones(16, P + 16, dtype=torch.bool).tril(P)
    import torch.nn.functional as F

    from treedraft import kernels

    for name, fn in [
        (
            "sdpa16",
            lambda: F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask[None, None], enable_gqa=True
            ),
        ),
        ("attend16", lambda: kernels.attend(q, k, v, mask, 0.125)),
        (
            "sdpa1",
            lambda: F.scaled_dot_product_attention(
                q[:1].transpose(0, 1)[None], k[None, :, : P + 1], v[None, :, : P + 1], enable_gqa=True
            ),
        ),
        ("attend1", lambda: kernels.attend(q[:1], k[:, : P + 1], v[:, : P + 1], None, 0.125)),
    ]:
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            ts.append((time.perf_counter() - t0) / 20 * 1e6)
        print(f"one layer {name}: median {statistics.median(ts):.0f} us")
for (exact, T), ts in sorted(res.items()):
    print(f"{'attend' if exact else 'sdpa  '} T={T:2d}: median {statistics.median(ts):.2f} ms  min {min(ts):.2f} ms")
print("threads", torch.get_num_threads())
