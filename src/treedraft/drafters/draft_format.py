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

MEDUSA_FORMATS = ("q8", "q4")  # the shared projection's copy (medusa_native.PROJ_FORMATS)
EAGLE_FORMATS = ("q8", "q4")  # the draft layer's linears (eagle_native.DRAFT_WEIGHTS; its head stays q8)


def cheapest(candidates: Sequence[T], cost: Callable[[T], float]) -> T:
    """The candidate with the lowest ``cost`` (the first on a tie: the formats are listed q8 first)."""
    if not candidates:
        raise ValueError("cheapest: no candidates")
    costs = [float(cost(c)) for c in candidates]
    return candidates[min(range(len(costs)), key=costs.__getitem__)]
