"""Sampling parameters and the logits -> probabilities transform shared by all rules."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as in vLLM), see SamplingParams


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters.

    A temperature below :data:`GREEDY_BELOW` is taken as 0 (greedy): sampling there is the argmax but for exact
    ties, and float32 logits divided by a temperature near float32's smallest (1e-38) overflow to inf / NaN."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (0 = off; vLLM's, llama.cpp's)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):  # (a string or None failed deep inside a comparison)
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
        if not (0 <= self.temperature < math.inf):  # (inf divided every logit to nan: junk text, not an error)
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.seed is not None:
            # an integer only (1.5 or "7" would quietly draw another seed's text), taken modulo 2**64 as the coupled
            # draws key it (-1 and 2**64 - 1 draw the same; torch.manual_seed refused seeds past 64 bits)
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise ValueError(f"seed must be an integer, got {self.seed!r} ({type(self.seed).__name__})")
            object.__setattr__(self, "seed", int(self.seed) % 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A seeded CPU generator; every draw (see :func:`sample`) happens on the CPU, whatever the model's device,
        so a seed gives the same tokens on cpu and cuda (for the same logits)."""
        g = torch.Generator()
        if self.seed is not None:
            g.manual_seed(int(self.seed))
        else:
            g.seed()
        return g


def target_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """(N, V) logits -> (N, V) probabilities after temperature, top-k, min-p and top-p (float32).

    z = logits / temperature; top-k keeps z >= the k-th largest (equal values all kept); min-p keeps z >= max z +
    log(min_p) (probabilities at least min_p x the best, with top-k and before top-p, as vLLM orders them); softmax;
    top-p drops,
    in descending probability order (equal probabilities: the lower id first), each token once the mass
    before it reaches top_p, and renormalises. On the CPU with the native kernel loaded, one native pass per
    row (kernels/sample.h); else these tensor ops. The two differ only in float rounding.
    """
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if logits.device.type == "cpu" and logits.dim() == 2:
        from . import kernels  # one native pass per row when the kernel is loaded (kernels/sample.h)

        out = kernels.sample_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
        if out is not None:
            return out
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.min_p > 0.0:  # p_j < min_p x max p  <=>  z_j - max z < log(min_p)
        best = logits.max(-1, keepdim=True).values
        logits = logits.masked_fill(logits - best < math.log(p.min_p), float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        probs = nucleus(probs, p.top_p)
    return probs


NUCLEUS_FIRST = 64  # candidates tried first by :func:`nucleus`; x8 each time they do not hold the nucleus


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """(N, V) probabilities -> top-p filtered and renormalised: tokens in descending probability order are
    dropped once the mass *before* them already reaches ``top_p`` (the first is always kept).

    Equal probabilities go lower id first (as the native sampler). The same tokens and values as sorting whole rows,
    without the sort: a 49k-token row took ~4-5 ms to sort on a 2-core Xeon, ~20x a decode step's sampling
    otherwise. The rows' ``k`` largest come from ``topk`` (``k`` = 64, then x8 up to the row's nonzero count)
    until every row's k-th candidate is itself dropped: cumulative sums only grow, so every later token is
    dropped too, and past the nonzero count only zeros are left.
    """
    V = probs.shape[-1]
    limit = max(1, int((probs > 0).sum(-1).max()))  # past it every row holds only zeros (top-k filtered)
    k = min(NUCLEUS_FIRST, V, limit)
    while True:
        sp, si = probs.topk(k, dim=-1)  # descending; equal values in no set order, and maybe not all taken
        tied_out = bool(((probs >= sp[..., -1:]).sum(-1) > k).any())  # the last value's ties go on past k
        if k < limit and tied_out:
            k = min(k * 8, limit)
            continue
        # equal probabilities: the lower id first (as kernels/sample.h): by id, then stably by value
        o = si.sort(dim=-1).indices
        sp, si = sp.gather(-1, o), si.gather(-1, o)
        o = sp.sort(dim=-1, descending=True, stable=True).indices
        sp, si = sp.gather(-1, o), si.gather(-1, o)
        before = sp.cumsum(-1) - sp
        if k >= limit or bool((before[..., -1] >= top_p).all()):
            break
        k = min(k * 8, limit)
    sp = sp.masked_fill(before >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, si, sp)
    return out / out.sum(-1, keepdim=True)


def sample(probs: Tensor, gen: torch.Generator) -> int:
    """Draw one token id from a (V,) distribution (on any device) with a CPU generator.

    Inverse transform of one float64 uniform (:func:`inverse_cdf`): exact, and over a 49k vocabulary ~10x
    cheaper than ``torch.multinomial``, which draws an exponential per token (benchmarks/coupled_acceptance.py).
    """
    return inverse_cdf(probs, uniform(gen))


def uniform(gen: torch.Generator) -> float:
    """One float64 uniform in [0, 1) from ``gen``: what every unseeded draw (:func:`sample`, :func:`draw`) inverts."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


# ---- coupled sampling: a token is a deterministic function of (seed, position, p) ----------------------
#
# A seeded request draws the token at absolute position t (its index in prompt + output) by the Gumbel-max
# trick, x_t = argmax_x log p_t(x) + G_t(x) over the tokens p_t keeps (after temperature/top-k/top-p), where
# G_t(x) ~ Gumbel(0, 1) is hashed from (seed, t, x) ONLY by a counter-based generator. So x_t ~ p_t exactly,
# and since G_t is independent of G_<t (which fixed the prefix and with it p_t), the sequence is distributed
# exactly as the model's. The output is a function of (seed, prompt, model) alone: whatever the drafter
# proposed and whoever shared the batch, each step commits the same tokens (see verify.accept_coupled). This is
# the common-random-numbers coupling of speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; SpecTr,
# Sun et al. 2023, arXiv:2310.15141, couple drafts and target through shared randomness the same way).
#
# Why Gumbel-max and not the inverse CDF (u_t one uniform, x_t = F_t^-1(u_t) in token-id order, used until
# session 38): a drafter that knows the noise can propose the top-k of ITS OWN log q + G_t, and where q is near p
# the two argmaxes agree whatever the vocabulary order; under the inverse CDF every difference between the two
# CDFs before a token shifts its interval, so the draft's own draw agreed less often than its plain top-1 (EAGLE
# depth 1 at T = 1, 10 MT-Bench first turns: own draw 0.22, top-1 0.27, top-4 0.47; Gumbel, perturbed top-1 0.34,
# top-4 0.57; benchmarks/results/session38.md). The V logarithms per row that made Gumbel-max slow here before
# (44-53 ms a step, benchmarks/results/coupled_acceptance.md) are skipped for every token that cannot win: token
# x can beat a score s only if v_x < p_x / exp(s)-ish (kernels/sample.h), one hash and one compare per token.

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (odd; 2^64 / golden ratio)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's output multipliers (kernels/sample.h mix64)


def _mix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators")."""
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """u ~ U[0, 1) (53 random bits) for token ``position`` of a request seeded with ``seed``: the top bits of
    :func:`gumbel_key` (SplitMix64 started at mix64(seed) and advanced ``position`` + 1 steps, computed directly).
    The inverse-CDF draws keyed it until session 38; coupled draws now take the key itself."""
    return (gumbel_key(seed, position) >> 11) * 2.0**-53


def inverse_cdf(probs: Tensor, u: float) -> int:
    """The token x with F(x - 1) <= u * F(V - 1) < F(x) for a (V,) distribution (any device), F its float64 CDF.

    Never returns a zero-probability token (F is flat over it); ``probs`` need not be exactly normalised.
    """
    cdf = probs.to(device="cpu").cumsum(0, dtype=torch.float64)  # (V,)
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no mass")
    x = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True))
    if x >= len(cdf):  # u * total rounded up to the total: the last token with mass
        x = int(torch.nonzero(probs.to(device="cpu") > 0)[-1])
    return x


def draw(logits: Tensor, p: SamplingParams, u: float) -> int:
    """F^-1(u) for a (V,) logits row under ``p`` (not greedy): :func:`inverse_cdf` of :func:`target_probs`.

    With the native kernel loaded, one native call on the row (moved to the CPU): 0.15-0.25 ms per SmolLM2 row
    against 0.35-0.5 ms for the tensor ops, and 4-5 ms with top-p while it sorted whole rows (Ice Lake Xeon,
    benchmarks/sampling_cost.py).
    """
    from . import kernels

    x = kernels.sample_draw(logits, p.temperature, p.top_k, p.top_p, u, p.min_p)
    if x is not None:
        return x
    return inverse_cdf(target_probs(logits[None], p)[0], u)


def gumbel_key(seed: int, position: int) -> int:
    """The 64-bit key of position ``position``'s Gumbel noise in a request seeded with ``seed``: SplitMix64 started
    at mix64(seed) and advanced ``position`` + 1 steps, computed directly, so a token's noise depends on (seed,
    position, token) alone. Seeds are taken modulo 2**64 (like torch.manual_seed)."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _mix64((_mix64(int(seed) & _M64) + (position + 1) * _GOLDEN) & _M64)


_TOKEN_STEP = 0xD1B54A32D192ED03  # kernels/sample.h kGumbelTokenStep: token j's counter is key + (j + 1) * step


def gumbel_noise(key: int, tokens: np.ndarray) -> np.ndarray:
    """G (float64) for token ids ``tokens`` under ``key``: -log(-log1p(-v)), v in (0, 1] the token's 53 hash bits
    (kernels/sample.h gumbel_v, in numpy's wrapping uint64 arithmetic)."""
    z = (np.uint64(key) + (tokens.astype(np.uint64) + np.uint64(1)) * np.uint64(_TOKEN_STEP)).astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z = z ^ (z >> np.uint64(31))
    v = ((z >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53
    with np.errstate(divide="ignore"):
        return -np.log(-np.log1p(-v))


def gumbel_topk(
    logits: Tensor, p: SamplingParams, key: int, k: int = 1, cols: Tensor | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The k tokens of p's support of a (V,) logits row with the largest (z - max z) + G, z = logits / T and G the
    Gumbel noise of each column's token id (``cols``, default the column) under ``key``, best first (equal scores:
    the lower column first), as (columns int64, scores float64); fewer when fewer tokens are kept. The first is
    an exact draw from p.

    One native call (kernels/sample.h) wherever the native kernel can be loaded: this loads it, so a process never
    draws some tokens natively and others by the numpy path. That path (``TREEDRAFT_NO_EXT=1``, or a machine without
    the kernel) takes its support from :func:`target_probs`' tensor ops, whose float32 sums can put the top-p
    boundary elsewhere than the native float64 ones in rare rows (a token's mass within rounding of the cut): a
    seeded text can then differ between a process with the kernel and one without, never within one process."""
    from . import kernels

    if p.greedy:
        raise ValueError("gumbel_topk needs a sampled (temperature > 0) SamplingParams")
    if logits.dim() != 1:
        raise ValueError(f"gumbel_topk takes one (V,) logits row, got shape {tuple(logits.shape)}")
    if k < 1:
        raise ValueError(f"gumbel_topk needs k >= 1, got {k}")
    row = logits.detach().to("cpu", torch.float32).contiguous()
    if cols is not None:
        cols = cols.to("cpu", torch.int64).contiguous()
        if cols.shape != row.shape:
            raise ValueError(f"cols must give one token id per logits column: {tuple(cols.shape)} for {row.numel()}")
    out = None
    if kernels.available():  # loads (or builds) the kernel: see above
        out = kernels.gumbel_topk(row, p.temperature, p.top_k, p.top_p, p.min_p, key, min(k, row.numel()), cols)
    if out is not None:
        return out[0].numpy(), out[1].numpy()
    keep = target_probs(row[None], p)[0] > 0  # the support, as the native pass keeps it (up to rounding)
    if not bool(keep.any()):
        raise ValueError("cannot sample from a distribution with no mass")
    z = row / p.temperature
    d = (z - z.max()).numpy().astype(np.float64)
    ids = np.arange(row.numel()) if cols is None else cols.numpy()
    score = np.where(keep.numpy(), d + gumbel_noise(key, ids), -np.inf)
    n = min(k, int(keep.sum()))
    order = np.lexsort((np.arange(score.size), -score))[:n]  # descending score, then the lower column
    return order.astype(np.int64), score[order]


def coupled_sample(logits: Tensor, p: SamplingParams, seed: int, position: int) -> int:
    """Token ``position`` of a coupled draw: the Gumbel-max draw from p keyed by (seed, position). logits: (V,)."""
    if p.greedy:
        return int(logits.argmax())
    return int(gumbel_topk(logits, p, gumbel_key(seed, position), 1)[0][0])
