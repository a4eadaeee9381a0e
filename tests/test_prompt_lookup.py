"""Prompt lookup drafter: n-gram matching and the adaptive continuation length."""

from __future__ import annotations

import pytest

from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.interfaces import DraftContext


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


def test_several_branches_from_distinct_matches_form_one_tree() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 4, 8, 2, 3, 5, 6, 9, 9, 2, 3]
    d = PromptLookupDrafter(max_branches=3, adaptive=False, num_tokens=2)
    # "2 3" occurs at 5 (-> 5 6) and at 1 (-> 4 8); most recent first; "3" alone adds nothing new
    assert d.candidates(tokens, 2) == [[5, 6], [4, 8]]
    tree = d.propose(DraftContext(tokens, None, max_nodes=64, max_depth=8))
    assert tree.tokens == (3, 5, 6, 4, 8) and tree.parents == (-1, 0, 1, 0, 3)  # two branches off the root
    # one branch only: the most recent match
    assert PromptLookupDrafter(max_branches=1, adaptive=False, num_tokens=2).candidates(tokens, 2) == [[5, 6]]
    # the same continuations found again by the shorter n-gram ("1") are not repeated
    rep = [7, 1, 2, 7, 1, 2, 4, 7, 1]
    assert PromptLookupDrafter(max_branches=4, adaptive=False, num_tokens=2).candidates(rep, 2) == [[2, 4], [2, 7]]
    # the budget cuts branches: a 3-node budget keeps the root and the first branch
    small = d.propose(DraftContext(tokens, None, max_nodes=3, max_depth=8))
    assert small.tokens == (3, 5, 6)


def test_multi_branch_lookup_keeps_greedy_output() -> None:
    from treedraft.engine import Engine, GenerationConfig
    from treedraft.models.tiny import tiny_llama

    engine = Engine(tiny_llama(seed=4, vocab_size=8, scale=2.0))
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = engine.generate(prompt, cfg, None)
    multi = engine.generate(prompt, cfg, PromptLookupDrafter(max_branches=3, adaptive=False, num_tokens=3))
    assert multi.token_ids == plain.token_ids
    assert any(s.tree_size > s.tree_depth + 1 for s in multi.stats.steps)  # some trees really branched
    assert multi.stats.accepted_tokens > 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        PromptLookupDrafter(max_tokens=0)
