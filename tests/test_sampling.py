"""The sampled step's distribution (temperature, top-k, top-p) and its draws: the tensor-op path, the native
one (kernels/sample.h) and a plain full-sort reference must describe the same distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treedraft import kernels
from treedraft.sampling import SamplingParams, draw, inverse_cdf, nucleus, target_probs


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition, in float64 with whole-row sorts: (N, V) logits -> (N, V) probabilities."""
    z = logits.double() / p.temperature
    if p.top_k and p.top_k < z.shape[-1]:
        kth = z.sort(-1, descending=True).values[..., p.top_k - 1 : p.top_k]
        z = z.masked_fill(z < kth, float("-inf"))
    if p.min_p > 0:  # probabilities below min_p x the best one's, before top-p
        probs = z.softmax(-1)
        z = z.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    probs = z.softmax(-1)
    if p.top_p < 1.0:
        out = torch.zeros_like(probs)
        for r in range(probs.shape[0]):
            order = sorted(range(probs.shape[1]), key=lambda j: (-float(probs[r, j]), j))
            before = 0.0
            for j in order:
                if before >= p.top_p or probs[r, j] == 0:
                    break
                out[r, j] = probs[r, j]
                before += float(probs[r, j])
        probs = out / out.sum(-1, keepdim=True)
    return probs


def sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """What :func:`nucleus` replaced: the whole rows sorted."""
    sp, si = probs.sort(-1, descending=True)
    sp = sp.masked_fill((sp.cumsum(-1) - sp) >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, si, sp)
    return out / out.sum(-1, keepdim=True)


def distinct_logits(rows: int, V: int, scale: float, seed: int) -> torch.Tensor:
    """Rows of distinct logits (a shuffled grid plus small noise): no two tokens tie, so every rule has one answer."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-scale, scale, V)
    return torch.stack([grid[torch.randperm(V, generator=g)] for _ in range(rows)]) + 1e-4 * torch.rand(
        rows, V, generator=g
    )


@pytest.fixture
def native():
    if not kernels.available():  # loads (or builds) the kernel in this process
        pytest.skip(f"native kernel unavailable: {kernels.unavailable_reason()}")
    return kernels


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(kernels, "sample_probs", lambda *a: None)
    monkeypatch.setattr(kernels, "sample_draw", lambda *a: None)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [2.0, 30.0])  # flat rows need several candidate rounds, peaked ones one
def test_nucleus_keeps_what_a_whole_row_sort_keeps(top_p: float, scale: float) -> None:
    probs = distinct_logits(3, 5000, scale, seed=1).softmax(-1)
    fast, ref = nucleus(probs, top_p), sort_nucleus(probs, top_p)
    assert torch.equal(fast > 0, ref > 0)
    assert torch.allclose(fast, ref, rtol=1e-5, atol=0)
    kept = (fast > 0).sum(-1)
    assert int(kept.min()) >= 1 and (top_p < 0.5 or int(kept.max()) > 1)


def test_nucleus_after_top_k_stops_at_the_kept_tokens() -> None:
    """Rows whose mass past top-k is zero: the candidates stop at the nonzero count, whatever top_p asks."""
    probs = distinct_logits(2, 300, 1.0, seed=2)
    probs = probs.masked_fill(probs < probs.topk(10, -1).values[..., -1:], float("-inf")).softmax(-1)
    for top_p in (0.3, 0.999999):
        fast = nucleus(probs, top_p)
        assert torch.equal(fast > 0, sort_nucleus(probs, top_p) > 0)
        assert int((fast > 0).sum(-1).max()) <= 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(0.7),
        SamplingParams(1.3, top_p=0.9),
        SamplingParams(0.5, top_k=7),
        SamplingParams(1.0, top_k=300, top_p=0.6),  # top-k past the insertion bound (nth_element)
        SamplingParams(0.8, top_k=40, top_p=0.95),
        SamplingParams(2.0, top_p=0.02),  # the best token alone
        SamplingParams(1.0, min_p=0.05),
        SamplingParams(1.2, top_k=50, top_p=0.9, min_p=0.02),
        SamplingParams(0.7, min_p=1.0),  # the best token alone
    ],
    ids=["T", "top_p", "top_k", "top_k-large", "top_k-top_p", "top_p-tiny", "min_p", "all", "min_p-1"],
)
@pytest.mark.parametrize("path", ["native", "tensor"])
def test_target_probs_follow_the_definition(params: SamplingParams, path: str, request) -> None:
    request.getfixturevalue("native" if path == "native" else "no_native")
    x = distinct_logits(3, 700, 12.0, seed=3)
    x[1, 5] = float("-inf")  # a banned token
    got, ref = target_probs(x, params), reference_probs(x, params)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got > 0, ref > 0), "a different set of tokens kept"
    assert torch.allclose(got.double(), ref, rtol=2e-5, atol=1e-9)
    assert float(got[1, 5]) == 0.0


def test_top_k_keeps_every_token_tied_with_the_kth(native) -> None:
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, -2.0]])
    p = target_probs(x, SamplingParams(1.0, top_k=2))
    assert (p[0] > 0).tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize(
    "params", [SamplingParams(0.9), SamplingParams(1.1, top_k=5, top_p=0.8), SamplingParams(1.0, min_p=0.1)]
)
def test_native_draws_invert_the_distributions_cdf(native, params: SamplingParams) -> None:
    x = distinct_logits(1, 400, 4.0, seed=4)[0]
    probs = reference_probs(x[None], params)[0]
    cdf = probs.cumsum(0).numpy()
    us = np.random.default_rng(0).random(2000)
    for u in us:
        if np.abs(cdf - u).min() < 1e-5:  # at a step of the CDF rounding decides; nothing to compare
            continue
        assert draw(x, params, float(u)) == inverse_cdf(probs, float(u))


def test_native_draws_are_distributed_as_the_probabilities(native) -> None:
    """Chi-square over 6 tokens, 30,000 uniform draws: p-value far from 0; the test fails on a shifted CDF."""
    x = torch.tensor([2.0, 0.5, -1.0, 1.5, float("-inf"), 0.0, 1.0])
    params = SamplingParams(0.8, top_p=0.97)
    probs = reference_probs(x[None], params)[0].numpy()
    us = np.random.default_rng(1).random(30_000)
    counts = np.bincount([draw(x, params, float(u)) for u in us], minlength=len(x))
    assert counts[4] == 0 and all(counts[probs == 0] == 0)
    keep = probs > 0
    expected = probs[keep] * len(us)
    chi2 = float((((counts[keep] - expected) ** 2) / expected).sum())
    assert chi2 < 25.0, f"chi-square {chi2:.1f} over {int(keep.sum()) - 1} degrees of freedom"


def test_a_draw_at_the_top_of_the_unit_interval_is_a_kept_token(native) -> None:
    x = torch.tensor([1.0, 3.0, float("-inf"), 2.0, -50.0])
    for params in (SamplingParams(1.0), SamplingParams(1.0, top_k=2), SamplingParams(1.0, top_p=0.5)):
        kept = reference_probs(x[None], params)[0] > 0
        for u in (0.0, 0.5, 1.0 - 2.0**-53):
            assert bool(kept[draw(x, params, u)])


def test_rows_without_a_finite_maximum_take_the_tensor_path(native, monkeypatch) -> None:
    for bad in (float("nan"), float("inf")):
        x = torch.tensor([[0.0, 1.0, bad, 2.0]])
        assert kernels.sample_probs(x, 1.0, 0, 0.9) is None
        assert kernels.sample_draw(x[0], 1.0, 0, 0.9, 0.5) is None
    assert kernels.sample_probs(torch.full((1, 4), float("-inf")), 1.0, 0, 1.0) is None
    x = torch.tensor([[0.0, 1.0, float("inf"), 2.0], [0.0, 1.0, 3.0, 2.0]])
    params = SamplingParams(1.0, top_p=0.9)
    got = target_probs(x, params)
    monkeypatch.setattr(kernels, "sample_probs", lambda *a: None)
    torch.testing.assert_close(got, target_probs(x, params), equal_nan=True)


@pytest.mark.parametrize("path", ["native", "tensor"])
def test_equal_probabilities_enter_the_nucleus_lower_id_first(path: str, request) -> None:
    request.getfixturevalue("native" if path == "native" else "no_native")
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    p = target_probs(x, SamplingParams(1.0, top_p=0.6))
    assert (p[0] > 0).tolist() == [True, True, True, False, False, False]
    y = torch.zeros(1, 200)
    y[0, 150:] = 1.0  # 50 tied best tokens past the first 64 candidates' ids
    params = SamplingParams(1.0, top_p=0.1)
    kept = (target_probs(y, params)[0] > 0).nonzero().flatten().tolist()
    assert kept == (reference_probs(y, params)[0] > 0).nonzero().flatten().tolist()
    assert kept == list(range(150, 150 + len(kept))) and 1 < len(kept) < 50


def test_seeds_are_integers_taken_modulo_2_64() -> None:
    """A seed past 64 bits drew an overflow error from torch in the CLI and the API (the server takes it modulo 2^64,
    as the README says); a float, string or bool seed was quietly another seed. Now: integers modulo 2^64, else a
    ValueError naming the seed."""
    import numpy as np

    assert SamplingParams(1.0, seed=2**64 + 5).seed == 5
    assert SamplingParams(1.0, seed=-1).seed == 2**64 - 1
    assert SamplingParams(1.0, seed=np.int64(7)).seed == 7
    g1, g2 = SamplingParams(1.0, seed=2**64 + 5).generator(), SamplingParams(1.0, seed=5).generator()
    assert torch.rand(3, generator=g1).tolist() == torch.rand(3, generator=g2).tolist()
    for bad in (1.5, "7", True, 7.0):
        with pytest.raises(ValueError, match="seed must be an integer"):
            SamplingParams(1.0, seed=bad)


def test_a_temperature_below_greedy_below_is_greedy() -> None:
    """Below GREEDY_BELOW the temperature is 0 for every consumer (target_probs, the native sampler): 1e-38 made
    float32 logits / temperature overflow to inf and NaN before."""
    from treedraft.sampling import GREEDY_BELOW

    for t in (1e-38, 5e-324, GREEDY_BELOW / 2):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.tensor([[3.0, 5.0, 1.0, 5.0 - 1e-3]])
    probs = target_probs(logits, SamplingParams(temperature=1e-38))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
