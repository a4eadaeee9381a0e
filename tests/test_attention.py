"""Row-invariant decode attention (treedraft.kernels.attend) and its use by the model's decode steps."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from native_utils import chain_steps, tiny_native_hd32

from treedraft import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    m = None if allowed is None else allowed[None, None]
    y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=m, enable_gqa=True)
    return y[0].transpose(0, 1)


def _random_tree(T: int, g: torch.Generator) -> list[int]:
    """Parent of each node (-1 = root child of the prefix); parents come before children."""
    return [-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(T)]


def _tree_allowed(parents: list[int], prefix: int) -> torch.Tensor:
    T = len(parents)
    allowed = torch.zeros(T, prefix + T, dtype=torch.bool)
    allowed[:, :prefix] = True
    for i in range(T):
        j = i
        while j >= 0:
            allowed[i, prefix + j] = True
            j = parents[j]
    return allowed


@pytest.mark.parametrize("path", kernels.paths())
@pytest.mark.parametrize("hd", [64, 40])
def test_attend_matches_sdpa(path: str, hd: int) -> None:
    g = torch.Generator().manual_seed(hd)
    T, nh, nkv, L = 7, 9, 3, 53
    q, k, v = (torch.randn(s, generator=g) for s in ((T, nh, hd), (nkv, L, hd), (nkv, L, hd)))
    allowed = torch.rand(T, L, generator=g) < 0.5
    allowed[:, 3] = True
    torch.testing.assert_close(
        kernels.attend(q, k, v, allowed, hd**-0.5, path=path), _sdpa(q, k, v, allowed), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        kernels.attend(q, k, v, None, hd**-0.5, path=path), _sdpa(q, k, v, None), atol=1e-5, rtol=0
    )


def test_all_paths_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(5, 6, 64, generator=g),
        torch.randn(2, 70, 64, generator=g),
        torch.randn(2, 70, 64, generator=g),
    )
    allowed = torch.rand(5, 70, generator=g) < 0.7
    outs = [kernels.attend(q, k, v, allowed, 0.125, path=p) for p in kernels.paths()]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("T", [1, 2, 5, 16, 20])
def test_tree_rows_equal_the_plain_step_bitwise(T: int) -> None:
    """Each tree row == the 1-row call over its allowed keys stored contiguously (what the plain step sees)."""
    g = torch.Generator().manual_seed(T)
    nh, nkv, hd, prefix = 9, 3, 64, 37 + T  # prefix not a multiple of the 16-key chunk
    L = prefix + T
    q = torch.randn(T, nh, hd, generator=g)
    k, v = torch.randn(nkv, L, hd, generator=g) * 3, torch.randn(nkv, L, hd, generator=g)
    allowed = _tree_allowed(_random_tree(T, g), prefix)
    tree = kernels.attend(q, k, v, allowed, hd**-0.5)
    for i in range(T):
        slots = allowed[i].nonzero()[:, 0]
        plain = kernels.attend(q[i : i + 1], k[:, slots].contiguous(), v[:, slots].contiguous(), None, hd**-0.5)
        assert torch.equal(tree[i], plain[0]), f"row {i} of {T}"


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 masked softmax attention: q (T, nh, hd), k/v (nkv, L, hd), allowed (T, L) -> (T, nh, hd)."""
    nh, nkv = q.shape[1], k.shape[0]
    kk, vv = k.double().repeat_interleave(nh // nkv, 0), v.double().repeat_interleave(nh // nkv, 0)
    s = torch.einsum("thd,hld->thl", q.double(), kk) * scale
    s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("thl,hld->thd", s.softmax(-1), vv)


# contexts around the 16-key chunk and the 128-key block (kernels/attn.h kBlock) boundaries
LONG = [127, 128, 129, 300, 700]


@pytest.mark.parametrize("path", kernels.paths())
@pytest.mark.parametrize("prefix", LONG)
def test_long_tree_matches_float64_reference(path: str, prefix: int) -> None:
    """Tree rows over several key blocks (split-K, folded in block order) match a float64 reference."""
    g = torch.Generator().manual_seed(prefix)
    T, nh, nkv, hd = 16, 9, 3, 64
    L = prefix + T
    q = torch.randn(T, nh, hd, generator=g)
    k, v = torch.randn(nkv, L, hd, generator=g) * 2, torch.randn(nkv, L, hd, generator=g)
    allowed = _tree_allowed(_random_tree(T, g), prefix)
    allowed[3, 5:90] = False  # a row with holes in its shared prefix
    out = kernels.attend(q, k, v, allowed, hd**-0.5, path=path)
    torch.testing.assert_close(out.double(), _reference(q, k, v, allowed, hd**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("L", LONG)
def test_all_paths_give_the_same_bits_over_many_blocks(L: int) -> None:
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(s, generator=g) for s in ((7, 6, 64), (2, L, 64), (2, L, 64)))
    allowed = torch.rand(7, L, generator=g) < 0.9
    allowed[:, :100] = True
    for a in (allowed, None):
        outs = [kernels.attend(q, k, v, a, 0.125, path=p) for p in kernels.paths()]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])


@pytest.mark.parametrize("prefix", [200, 613])
def test_rows_bitwise_equal_across_row_counts_and_threads(prefix: int) -> None:
    """A row's bits depend on nothing but its own query and keys: not on T, its neighbours or the threads."""
    g = torch.Generator().manual_seed(prefix)
    nh, nkv, hd, Tmax = 9, 3, 64, 64
    L = prefix + Tmax
    q = torch.randn(Tmax, nh, hd, generator=g)
    k, v = torch.randn(nkv, L, hd, generator=g) * 3, torch.randn(nkv, L, hd, generator=g)
    allowed = _tree_allowed(_random_tree(Tmax, g), prefix)
    threads = kernels.get_num_threads()
    try:
        ref = None
        for n_threads in (1, 2, 3):
            kernels.set_num_threads(n_threads)
            for T in (1, 2, 16, 64):
                rows = torch.arange(T)
                rows[-1] = 9  # row 9 of the tree, last of T rows (the others: rows 0..T-2)
                out = kernels.attend(q[rows], k, v, allowed[rows], hd**-0.5)
                ref = out[-1] if ref is None else ref
                assert torch.equal(out[-1], ref), (n_threads, T)
    finally:
        kernels.set_num_threads(threads)
    slots = allowed[9].nonzero()[:, 0]  # and the plain step over the same keys stored contiguously
    plain = kernels.attend(q[9:10], k[:, slots].contiguous(), v[:, slots].contiguous(), None, hd**-0.5)
    assert torch.equal(plain[0], ref)


@pytest.mark.skipif("avx512" not in kernels.paths(), reason="block GEMM path is AVX-512 only")
@pytest.mark.parametrize("hd", [16, 32, 64, 128])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 6, 8, 12, 22])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_block_gemm_equals_chunk_path_bitwise(hd: int, T: int, kv_dtype: torch.dtype) -> None:
    """AVX-512's per-block GEMM passes (kernels/attn_gemm.h) give the chunk-by-chunk path's bits, tree and plain,
    for float32 and float16 caches (3 queries per kv head and row: T = 1 stays on the chunk path, T >= 2 has
    >= 6 queries per GEMM call, odd counts leave a last query outside the score pairs; from T = 12 on (36 queries)
    fp16 keys are widened per chunk before the score pass)."""
    ext = kernels._ext()
    g = torch.Generator().manual_seed(hd + T)
    nh, nkv, prefix = 9, 3, 300  # 2 full blocks + 44 shared keys (2 full chunks and a partial one)
    L = prefix + T
    q = torch.randn(T, nh, hd, generator=g)
    k = (torch.randn(nkv, L, hd, generator=g) * 3).to(kv_dtype)
    v = torch.randn(nkv, L, hd, generator=g).to(kv_dtype)
    allowed = _tree_allowed(_random_tree(T, g), prefix)
    allowed[T // 2, 140:150] = False  # one row with a hole: fewer shared chunks in its block
    try:
        outs = []
        for on in (True, False):
            ext.set_attn_block_gemm(on)
            outs.append([kernels.attend(q, k, v, a, hd**-0.5) for a in (allowed, None)])
    finally:
        ext.set_attn_block_gemm(True)
    for new, old in zip(*outs, strict=True):
        assert torch.equal(new, old)


@pytest.mark.parametrize("path", kernels.paths())
@pytest.mark.parametrize("hd", [64, 40])
@pytest.mark.parametrize("prefix", [37, 300])
def test_fp16_kv_equals_fp32_on_the_rounded_values(path: str, hd: int, prefix: int) -> None:
    """An fp16 KV cache is read by widening each element exactly: the float32 call on k.float() bitwise."""
    g = torch.Generator().manual_seed(prefix + hd)
    T, nh, nkv = 16, 9, 3
    L = prefix + T
    q = torch.randn(T, nh, hd, generator=g)
    k, v = (torch.randn(nkv, L, hd, generator=g) * 3).half(), torch.randn(nkv, L, hd, generator=g).half()
    k[0, 5, :3] = torch.tensor([6e-8, -1e-5, 60000.0]).half()  # a subnormal, a small and a large half
    allowed = _tree_allowed(_random_tree(T, g), prefix)
    for a in (allowed, None):
        half = kernels.attend(q, k, v, a, hd**-0.5, path=path)
        assert torch.equal(half, kernels.attend(q, k.float(), v.float(), a, hd**-0.5, path=path))
    i = 9  # and a tree row equals the 1-row call over its keys stored contiguously in fp16
    slots = allowed[i].nonzero()[:, 0]
    plain = kernels.attend(q[i : i + 1], k[:, slots].contiguous(), v[:, slots].contiguous(), None, hd**-0.5, path=path)
    assert torch.equal(plain[0], kernels.attend(q, k, v, allowed, hd**-0.5, path=path)[i])


@pytest.mark.skipif("avx512" not in kernels.paths(), reason="AVX-512 register path")
@pytest.mark.parametrize("hd", [16, 32, 64, 128])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_one_row_gqa_groups_equal_scalar_bitwise(hd: int, kv_dtype: torch.dtype) -> None:
    """A 1-row step's GQA group (1..5 query heads per kv head) through AVX-512's joint-score chunk path
    (kernels/attn_avx512.h: each key loaded once for the group's queries) gives the scalar path's bits."""
    g = torch.Generator().manual_seed(hd)
    nkv, L = 2, 300  # 2 full blocks + 44 keys: full chunks across a block edge and a partial chunk
    k, v = (torch.randn(nkv, L, hd, generator=g) * 3).to(kv_dtype), torch.randn(nkv, L, hd, generator=g).to(kv_dtype)
    for group in range(1, 6):
        q = torch.randn(1, nkv * group, hd, generator=g)
        fast = kernels.attend(q, k, v, None, hd**-0.5, path="avx512")
        assert torch.equal(fast, kernels.attend(q, k, v, None, hd**-0.5, path="scalar")), group
        assert torch.equal(fast, kernels.attend(q, k, v, None, hd**-0.5, path="avx2")), group


def test_sdpa_is_not_row_invariant_here() -> None:
    """The property the kernel exists for is not free: SDPA's masked tree rows differ from the 1-row call."""
    g = torch.Generator().manual_seed(0)
    differs = 0
    for _ in range(20):
        T, nh, nkv, hd, prefix = 12, 9, 3, 64, 300
        q = torch.randn(T, nh, hd, generator=g)
        k, v = torch.randn(nkv, prefix + T, hd, generator=g) * 3, torch.randn(nkv, prefix + T, hd, generator=g)
        allowed = _tree_allowed(_random_tree(T, g), prefix)
        tree = _sdpa(q, k, v, allowed)
        for i in range(T):
            slots = allowed[i].nonzero()[:, 0]
            differs += not torch.equal(tree[i], _sdpa(q[i : i + 1], k[:, slots], v[:, slots], None)[0])
    assert differs > 0


def test_attend_rejects_bad_shapes() -> None:
    q, k = torch.randn(2, 4, 64), torch.randn(3, 10, 64)
    with pytest.raises(RuntimeError, match="multiple of nkv"):
        kernels.attend(q, k, k, None, 0.125)
    with pytest.raises(RuntimeError, match="allowed"):
        kernels.attend(torch.randn(2, 6, 64), k, k, torch.ones(3, 10, dtype=torch.bool), 0.125)
    with pytest.raises(ValueError, match="float32"):
        kernels.attend(q.double(), k.double(), k.double(), None, 0.125)
    with pytest.raises(ValueError, match="float16"):
        kernels.attend(q, k.half(), k, None, 0.125)


def _tiny_native():
    """A tiny seeded model with every linear swapped for a native q4 linear (as load(weights='int4') does)."""
    from native_utils import tiny_native

    return tiny_native(max_seq_len=64)


@pytest.mark.parametrize("exact", [True, False])
def test_tiny_native_model_tree_step_equals_plain_steps(exact: bool) -> None:
    """Native linears switch on exact attention; then a chain verified as one T=6 step equals six 1-token steps."""
    model = _tiny_native()
    assert model.exact_attention  # set by swap_linears
    model.exact_attention = exact
    g = torch.Generator().manual_seed(3)
    same = 0
    for _ in range(5):
        prompt, chain = torch.randint(0, 64, (21,), generator=g), torch.randint(0, 64, (6,), generator=g)
        plain, tree = chain_steps(model, prompt, chain)
        torch.testing.assert_close(tree, plain, atol=1e-4, rtol=1e-4)
        same += torch.equal(tree, plain)
    # SDPA (exact=False) is expected to differ somewhere; the native attention never
    assert same == 5 if exact else same < 5


# ---- bf16 scores (kernels.attend(bf16_scores=True), Transformer.bf16_scores) ----------------------------------------

bf16_only = pytest.mark.skipif(
    not kernels.available() or not kernels.bf16_scores_supported(), reason="needs a native build with AVX512-BF16"
)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _dotb_reference(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (hd,), k (L, hd) -> (L,) scores as the documented bf16 dot, in float32 numpy-free torch ops: lane l of 16
    adds q k at 32i + 2l + 1 then at 32i + 2l (each product exact, each sum rounded), then the lane tree."""
    qb, kb = _bf16(q), _bf16(k)
    lane = torch.zeros(k.shape[0], 16)
    for i in range(q.shape[0] // 32):
        for off in (1, 0):
            idx = 32 * i + 2 * torch.arange(16) + off
            lane = lane + kb[:, idx] * qb[idx]  # float32: the exact product (8 x 8 bits) rounded once in the sum
    for w in (8, 4, 2, 1):
        lane = lane[:, :w] + lane[:, w : 2 * w]
    return lane[:, 0]


@bf16_only
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 40])
def test_bf16_scores_same_bits_on_every_path_and_row_count(kv_dtype: torch.dtype, T: int) -> None:
    """bf16 scores: the AVX-512 instruction path (chunk and block-GEMM kernels), the AVX2 path and the scalar
    emulation give the same bits, and each tree row equals the one-row step over its own keys, as in float32."""
    g = torch.Generator().manual_seed(T)
    nh, nkv, hd, prefix = 9, 3, 64, 300
    L = prefix + T
    q = torch.randn(T, nh, hd, generator=g) * 2
    k = (torch.randn(nkv, L, hd, generator=g) * 2).to(kv_dtype)
    v = torch.randn(nkv, L, hd, generator=g).to(kv_dtype)
    allowed = _tree_allowed(_random_tree(T, g), prefix)
    outs = [kernels.attend(q, k, v, allowed, hd**-0.5, path=p, bf16_scores=True) for p in kernels.paths()]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for t in range(T):
        slots = allowed[t].nonzero()[:, 0]
        one = kernels.attend(q[t : t + 1], k[:, slots].contiguous(), v[:, slots].contiguous(), None, hd**-0.5,
                             bf16_scores=True)  # fmt: skip
        assert torch.equal(one[0], outs[0][t]), t
    fp32 = kernels.attend(q, k, v, allowed, hd**-0.5)
    assert not torch.equal(fp32, outs[0])  # another arithmetic: close, not the same
    torch.testing.assert_close(outs[0], fp32, atol=0.1, rtol=0.05)


@bf16_only
def test_bf16_scores_are_the_documented_dot() -> None:
    """Two keys per query: the weight of key 0 is sigmoid(s0 - s1), so its logit gives the score difference, which must
    be the documented bf16 dot's (q, k rounded to bf16, lane order), not the float32 dot's."""
    g = torch.Generator().manual_seed(5)
    hd, moved = 64, 0
    for _ in range(50):
        q = torch.randn(1, 1, hd, generator=g) * 0.3
        k = torch.randn(1, 2, hd, generator=g)
        v = torch.zeros(1, 2, hd)
        v[0, 0, 0] = 1.0  # out[0] = the weight of key 0
        w = float(kernels.attend(q, k, v, None, 1.0, bf16_scores=True)[0, 0, 0])
        if w * (1 - w) < 0.01:  # a saturated weight says too little about the logit
            continue
        got = math.log(w / (1 - w))
        s = _dotb_reference(q[0, 0], k[0])
        s32 = (q[0, 0].double() * k[0].double()).sum(-1)
        assert abs(got - float(s[0] - s[1])) < 2e-5
        moved += abs(float(s[0] - s[1]) - float(s32[0] - s32[1])) > 2e-4
    assert moved > 10  # the bf16 rounding is visible at this scale, so the check above tells the two dots apart


def test_bf16_scores_fall_back_to_float32_where_hd_is_not_a_multiple_of_32() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(3, 4, 40, generator=g),
        torch.randn(2, 50, 40, generator=g),
        torch.randn(2, 50, 40, generator=g),
    )
    if not kernels.bf16_scores_supported():
        pytest.skip("needs a native build with AVX512-BF16 for the default path")
    assert torch.equal(kernels.attend(q, k, v, None, 0.2, bf16_scores=True), kernels.attend(q, k, v, None, 0.2))


@bf16_only
def test_tiny_native_model_with_bf16_scores_tree_step_equals_plain_steps() -> None:
    """The model switch reaches the fused decoder: a chain verified as one step equals six 1-token steps bitwise,
    and differs from the float32-score model's hidden states."""
    model = tiny_native_hd32(64)
    g = torch.Generator().manual_seed(4)
    prompt, chain = torch.randint(0, 64, (40,), generator=g), torch.randint(0, 64, (6,), generator=g)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return chain_steps(model, prompt, chain)

    f_plain, f_tree = run()
    model.bf16_scores = True
    b_plain, b_tree = run()
    assert torch.equal(b_tree, b_plain) and torch.equal(f_tree, f_plain)
    assert not torch.equal(b_plain, f_plain)
    model.bf16_scores = False
    again, _ = run()
    assert torch.equal(again, f_plain)  # switched back: float32 scores again (the decoder was rebuilt)
