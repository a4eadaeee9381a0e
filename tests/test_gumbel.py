"""Gumbel-max coupled draws (treedraft.sampling.coupled_sample, kernels/sample.h gumbel_topk_row) and the drafters'
perturbed picks (drafters/eagle_tree.coupled_pick): exact draws from p, the native pruning equal to a brute-force
scan, and a draft close to the target proposing the target's own token."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from treedraft import kernels
from treedraft.drafters.eagle_tree import coupled_pick
from treedraft.sampling import (
    SamplingParams,
    coupled_sample,
    gumbel_key,
    gumbel_noise,
    gumbel_topk,
    target_probs,
)

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=20),
    SamplingParams(temperature=0.5, min_p=0.05),
]


def brute_force(row: torch.Tensor, p: SamplingParams, key: int, k: int, cols=None) -> list[int]:
    """The definition: every kept token's (z - max z) + G in float64, sorted (equal scores: lower column first)."""
    keep = (target_probs(row[None], p)[0] > 0).numpy()
    z = (row / p.temperature).double()
    d = (z - z.max()).numpy()
    ids = np.arange(row.numel()) if cols is None else cols.numpy()
    g = gumbel_noise(key, ids)
    order = sorted((j for j in range(row.numel()) if keep[j]), key=lambda j: (-(d[j] + g[j]), j))
    return order[:k]


@pytest.fixture
def native():
    if not kernels.available():
        pytest.skip(f"native kernel unavailable: {kernels.unavailable_reason()}")
    return kernels


@pytest.mark.parametrize("params", PARAMS)
def test_native_top_k_equals_a_brute_force_scan(native, params: SamplingParams) -> None:
    """The native pass prunes tokens by one hash and compare; what it returns must be the whole row's best k."""
    g = torch.Generator().manual_seed(0)
    for t in range(40):
        V = [50, 3000, 49152][t % 3]
        row = torch.randn(V, generator=g) * (1.0 + 4.0 * (t % 2))  # flat and peaked rows
        key = gumbel_key(11, t)
        ids, scores = gumbel_topk(row, params, key, 6)
        assert list(ids) == brute_force(row, params, key, 6)[: len(ids)]
        assert np.all(np.diff(scores) <= 0)


def test_native_and_numpy_paths_agree_with_a_reduced_vocabulary(native, monkeypatch) -> None:
    """With ``cols`` (a drafter's reduced vocabulary) the noise is keyed by the token id, not the column."""
    g = torch.Generator().manual_seed(1)
    cols = torch.randperm(49152, generator=g)[:4096].sort().values
    for t in range(30):
        row = torch.randn(4096, generator=g) * 3
        key = gumbel_key(5, t)
        a = gumbel_topk(row, PARAMS[0], key, 4, cols)[0]
        assert list(a) == brute_force(row, PARAMS[0], key, 4, cols)
        monkeypatch.setattr(kernels, "gumbel_topk", lambda *x, **y: None)
        assert list(gumbel_topk(row, PARAMS[0], key, 4, cols)[0]) == list(a)
        monkeypatch.undo()
    # keyed by ids: the same logits under other ids draw other tokens
    row = torch.zeros(4096)
    picks = {int(gumbel_topk(row, PARAMS[0], gumbel_key(5, t), 1, cols)[0][0]) for t in range(50)}
    shifted = {int(gumbel_topk(row, PARAMS[0], gumbel_key(5, t), 1, cols + 1)[0][0]) for t in range(50)}
    assert picks != shifted


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.8)])
def test_coupled_draws_are_distributed_as_the_probabilities(params: SamplingParams) -> None:
    """Across positions the coupled draw is an exact sample of p (chi-square, 5 degrees of freedom at most)."""
    x = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -3.0])
    p = target_probs(x[None], params)[0].double().numpy()
    n = 20000
    counts = np.bincount([coupled_sample(x, params, 3, t) for t in range(n)], minlength=6)
    kept = p > 0
    assert counts[~kept].sum() == 0
    chi2 = float((((counts - n * p) ** 2)[kept] / (n * p[kept])).sum())
    assert chi2 < 20.5, (chi2, counts, n * p)  # p = 0.001 for 5 degrees of freedom


def test_the_noise_is_independent_per_token_and_position() -> None:
    """Equal logits must give each token its share: noise shared across tokens, or reused across positions, fails."""
    x = torch.zeros(8)
    draws = [coupled_sample(x, SamplingParams(temperature=1.0), 9, t) for t in range(8000)]
    counts = np.bincount(draws, minlength=8)
    assert counts.min() > 850 and counts.max() < 1150
    assert len({coupled_sample(x, SamplingParams(temperature=1.0), s, 0) for s in range(64)}) == 8


def test_a_draft_near_the_target_picks_the_targets_draw() -> None:
    """The point of Gumbel-max coupling: with q a slightly perturbed p over a flat 2,000-token row, the perturbed
    top-1 of q is the target's draw most of the time, far more often than q's own top-1 (which knows no noise)."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    same = top1 = 0
    n = 300
    for t in range(n):
        target = torch.randn(2000, generator=g)
        draft = target + 0.1 * torch.randn(2000, generator=g)
        x = coupled_sample(target, params, 21, t)
        same += int(gumbel_topk(draft, params, gumbel_key(21, t), 1)[0][0]) == x
        top1 += int(draft.argmax()) == x
    assert same / n > 0.8 and top1 / n < 0.2, (same / n, top1 / n)


def test_coupled_pick_proposes_the_targets_draws_by_depth() -> None:
    """coupled_pick keys depth d's row by position len(tokens) + d and maps columns through the vocabulary: a
    draft equal to the target proposes the target's coupled draw first at every depth; greedy and uncoupled
    requests get no pick (the top-k)."""
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.8)
    ctx = SimpleNamespace(sampling=params, coupling=77, tokens=[1, 2, 3, 4, 5])
    vocab = np.arange(0, 600, 2)  # column c is token 2c
    rows = torch.randn(3, 300, generator=g) * 2
    vals, ids = coupled_pick(ctx, 3, vocab)(rows, [0, 1, 2])
    assert ids.shape == (3, 3) and vals.shape == (3, 3) and np.all(np.diff(vals, axis=1) <= 0)
    for d in range(3):
        full = torch.full((600,), float("-inf"))
        full[torch.from_numpy(vocab)] = rows[d]
        assert vocab[ids[d, 0]] == coupled_sample(full, params, 77, 5 + d)
    assert coupled_pick(SimpleNamespace(sampling=SamplingParams(), coupling=None, tokens=[1]), 3) is None
    assert coupled_pick(SimpleNamespace(sampling=params, coupling=None, tokens=[1]), 3) is None


def test_a_process_draws_natively_from_its_first_token(native) -> None:
    """The first coupled draw loads the kernel, so no process draws some tokens by the numpy path and later ones
    natively. This row's top-p boundary falls differently under the numpy path's float32 sums (found by a review):
    a fresh process must draw the native token before and after anything else loads the kernel."""
    script = (
        "import torch\n"
        "from treedraft import kernels\n"
        "from treedraft.sampling import SamplingParams, coupled_sample\n"
        "x = torch.tensor([-1.3499267101287842, -1.0986123085021973, -1.216395378112793, -3.295836925506592,"
        " -2.602689743041992])\n"
        "p = SamplingParams(temperature=1.0, top_p=0.962963)\n"
        "first = coupled_sample(x, p, 1, 12)\n"
        "kernels.available()\n"
        "print(first, coupled_sample(x, p, 1, 12))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1], out


def test_bad_arguments_are_refused() -> None:
    """Two-dimensional logits, k < 1 and a vocabulary map of another length are errors, not silent broadcasts."""
    row = torch.randn(10)
    s = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="one \\(V,\\) logits row"):
        gumbel_topk(row[None], s, 1, 1)
    with pytest.raises(ValueError, match="k >= 1"):
        gumbel_topk(row, s, 1, 0)
    with pytest.raises(ValueError, match="one token id per logits column"):
        gumbel_topk(row, s, 1, 1, torch.tensor([3]))
    with pytest.raises(ValueError, match="sampled"):
        gumbel_topk(row, SamplingParams(), 1, 1)
    # other integer dtypes are taken as token ids
    assert list(gumbel_topk(row, s, 5, 3, torch.arange(10, dtype=torch.int32))[0]) == list(
        gumbel_topk(row, s, 5, 3, torch.arange(10))[0]
    )
