"""Which rounded copy of a drafter's weights drafts fastest on this machine: q8 or q4, chosen by measurement.

Drafting on the native kernels streams rounded copies of the drafter's weights every step (Medusa: the shared
projection, 16,384 x 576 for the shipped heads; EAGLE: the draft decoder layer). In decoding the target's own
weights (66 MB at int4 for SmolLM2-135M) pass through the caches between two drafts and evict them, so a draft
mostly reads its weights from memory, and a q4 copy reads 0.6x the bytes of a q8 one; but unpacking 4-bit
codes costs more instructions, so which is faster depends on the machine's bandwidth and cores. Each
candidate's cost is measured as in decoding (right after a target forward: ``timed_after_forwards``), cached
per machine with the format in the key, and the cheaper one drafts. Rounding only moves which candidates are
proposed at near-ties; every drafted token is verified, so outputs never change.

Draft quality, measured on SmolLM2-135M (benchmarks/draft_format_quality.py, eagle_profile.py --draft-weights):
the formats offered here keep it (EAGLE with a q4 draft *head* did not, so its head stays q8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# The shared projection's copy (medusa_native.PROJ_FORMATS), q8 first: its q4 copy ranks slightly worse (head top-1
# 0.411 -> 0.405 on the MT-Bench answers), so q4 drafts only where it measures cheaper.
MEDUSA_FORMATS = ("q8", "q4")
# The draft layer's linears (eagle_native.DRAFT_WEIGHTS; the head stays q8), q4 first: it drafts as well (full-tree
# mean accepted 2.23 vs 2.22) and ran faster in situ in every A/B on the Ice Lake Xeon (+1.4% to +11%, four runs
# over 92 prompts) while the two measured draft costs tied (0.679 vs 0.675 of a one-row forward), so q8 must
# measure clearly cheaper to be chosen.
EAGLE_FORMATS = ("q4", "q8")
EAGLE_PREFER_WITHIN = 0.05  # the first listed EAGLE copy is kept unless another costs over 5% less


def cheapest(candidates: Sequence[T], cost: Callable[[T], float], prefer_within: float = 0.0) -> T:
    """The candidate with the lowest ``cost``; the first on a tie, and also while it costs at most
    ``1 + prefer_within`` times the lowest (a preferred candidate listed first)."""
    if not candidates:
        raise ValueError("cheapest: no candidates")
    costs = [float(cost(c)) for c in candidates]
    best = min(range(len(costs)), key=costs.__getitem__)
    return candidates[0] if costs[0] <= costs[best] * (1.0 + prefer_within) else candidates[best]
