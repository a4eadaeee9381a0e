"""Prompt lookup drafter: n-gram matching and the adaptive continuation length."""

from __future__ import annotations

import pytest

from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import DraftContext


def _propose(d: PromptLookupDrafter, tokens: list[int], max_depth: int = 64) -> list[int]:
    tree = d.propose(DraftContext(tokens, None, max_nodes=64, max_depth=max_depth))
    assert list(tree.parents) == list(range(-1, len(tree) - 1))  # one branch: a chain
    return list(tree.tokens[1:])


def test_match_length_counts_how_far_the_match_runs_backwards() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5]
    # the last 3 tokens (3 4 5) occur at 3; before them 1 2 match too, 9 != 7: a run of 5
    assert PromptLookupDrafter.match_length(tokens, 3, 3) == 5
    assert PromptLookupDrafter.match_length([1, 2, 8, 2], 1, 1) == 1  # 1 != 8 right before


def test_adaptive_branch_is_as_long_as_the_match_so_far() -> None:
    tokens = [9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5]
    assert _propose(PromptLookupDrafter(), tokens) == [7, 1, 2, 3, 4]  # run of 5 -> 5 tokens
    assert _propose(PromptLookupDrafter(max_tokens=2), tokens) == [7, 1]
    assert _propose(PromptLookupDrafter(), tokens, max_depth=3) == [7, 1, 2]
    assert _propose(PromptLookupDrafter(adaptive=False, num_tokens=2), tokens) == [7, 1]
    # a one-token match is worth one draft token only (fixed length would propose three)
    short = [5, 6, 7, 8, 9, 4, 3, 2, 1, 6]
    assert _propose(PromptLookupDrafter(), short) == [7]
    assert _propose(PromptLookupDrafter(adaptive=False), short) == [7, 8, 9]
    # a long verbatim repeat: the branch grows to max_tokens
    text = list(range(100, 130))
    # (the last 20 tokens repeat text[:20]: a run of 20, cut to 12: text[20:30], then 1, then text[0])
    assert _propose(PromptLookupDrafter(max_tokens=12), text + [1] + text[:20]) == text[20:30] + [1, 100]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        PromptLookupDrafter(max_tokens=0)
