"""Predicted outputs (OpenAI's ``prediction``): the text drafters draft from a caller's guess of the answer; the
answer itself never changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.engine import Engine, GenerationConfig, GenerationStats
from treedraft.interfaces import DraftContext, GenerationError
from treedraft.models.tiny import tiny_llama
from treedraft.server.responses import prediction_tokens


def test_prompt_lookup_drafts_from_the_prediction() -> None:
    d = PromptLookupDrafter()
    tokens = [1, 2, 3, 7, 8]
    assert d.candidates(tokens, 8) == []  # nothing to copy in the prompt itself
    # "7 8" occurs in the prediction: its run back is 2 tokens (5 != 3), so 2 tokens of continuation
    assert d.candidates(tokens, 8, [5, 7, 8, 9, 10, 11]) == [[9, 10]]
    # a match at the prediction's end continues into nothing: no branch runs across into the prompt
    assert d.candidates(tokens, 8, [4, 7, 8]) == []
    assert all(-1 not in c for c in PromptLookupDrafter(max_branches=4).candidates(tokens, 8, [7, 8, 1, 2, 3, 7, 8]))
    # the prediction's aligned occurrence (a run of 6) beats a stray recent one of the same n-gram (a run of 3)
    tokens = [4, 7, 8, 50, 51, 1, 2, 3, 4, 7, 8]
    assert d.candidates(tokens, 12) == [[50, 51, 1]]
    assert d.candidates(tokens, 12, [1, 2, 3, 4, 7, 8, 60, 61, 62, 63]) == [[60, 61, 62, 63]]
    tree = d.propose(DraftContext(tokens, None, 16, 8, 2, reference=(1, 2, 3, 4, 7, 8, 60, 61, 62, 63)))
    assert tree.tokens == (8, 60, 61, 62, 63)


def test_suffix_drafts_from_the_prediction_and_forgets_it_with_the_request() -> None:
    d = SuffixDrafter(None)  # request-local index only
    ref = (5, 7, 8, 9, 10, 11, 12)
    tree = d.propose(DraftContext([1, 2, 3, 7, 8], None, 16, 8, 2, reference=ref))
    assert tree.tokens[:3] == (8, 9, 10)
    assert len(d.propose(DraftContext([1, 2, 3, 7, 8], None, 16, 8, 2))) == 1  # the next request: nothing


def test_the_answer_is_the_same_with_any_prediction_and_a_good_one_is_accepted() -> None:
    engine = Engine(tiny_llama(seed=4, vocab_size=64, scale=2.0))
    prompt = [1, 2, 3, 4, 5, 6]
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain = engine.generate(prompt, cfg, None).token_ids
    edited = [*plain[:20], 63, 62, *plain[24:]]  # a prediction with a changed stretch
    for make in (PromptLookupDrafter, lambda: SuffixDrafter(None)):
        accepted = {}
        for name, pred in (("none", ()), ("exact", plain), ("edited", edited), ("wrong", list(range(40, 60)))):
            out = engine.generate(
                prompt, GenerationConfig(max_new_tokens=48, ignore_eos=True, prediction=tuple(pred)), make()
            )
            assert out.token_ids == plain, name
            accepted[name] = out.stats.mean_accepted_length
        assert accepted["exact"] > 4 * accepted["none"] and accepted["exact"] > 5, accepted
        assert accepted["edited"] > 1.5 * accepted["none"], accepted  # recovers after the edit
    with pytest.raises(GenerationError, match="outside this model's vocabulary"):
        engine.generate(prompt, GenerationConfig(max_new_tokens=4, prediction=(64,)), PromptLookupDrafter())
    with pytest.raises(GenerationError, match="token ids"):
        GenerationConfig(prediction=(-1,))


def test_prediction_usage_counts_the_predictions_tokens_found_in_the_answer() -> None:
    assert prediction_tokens([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 0)
    assert prediction_tokens([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == (4, 1)  # 3 was replaced, 6 is new
    assert prediction_tokens([7, 7, 7], []) == (0, 3)
    assert prediction_tokens([5, 6] * 2000, [6, 5, 5] * 1333) == (3332, 668)  # a loop: was 14 s with difflib


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_accepted_prediction_tokens_are_the_longest_common_subsequence(pred: list[int], out: list[int]) -> None:
    dp = [0] * (len(out) + 1)  # the textbook dynamic programme, one row at a time
    for x in pred:
        prev = 0
        for j, y in enumerate(out):
            prev, dp[j + 1] = dp[j + 1], prev + 1 if x == y else max(dp[j + 1], dp[j])
    assert prediction_tokens(pred, out) == (dp[-1], len(pred) - dp[-1])


@pytest.mark.slow
def test_real_model_default_drafter_with_a_prediction_equals_plain(smollm_int4) -> None:
    llm = smollm_int4
    from treedraft.drafters import registry
    from treedraft.drafters.registry import DrafterOptions
    from treedraft.drafters.suffix_store import SuffixStore

    prompt = "Write a Python function that returns the squares of a list of numbers."
    plain = llm.generate(prompt, drafter=None, max_new_tokens=64)
    stats = {}
    for name, pred in (("none", None), ("exact", plain.text), ("edited", plain.text.replace("numbers", "values"))):
        # the default drafter, each time with an empty store of its own: no earlier output drafts this one
        d = registry.build(
            "default", llm.model, llm.tokenizer, DrafterOptions(llm.model_name, suffix_store=SuffixStore())
        )
        s = GenerationStats()
        out = [
            t for c in llm.stream(prompt, drafter=d, stats=s, max_new_tokens=64, prediction=pred) for t in c.token_ids
        ]
        assert out == plain.token_ids, name
        stats[name] = s.mean_accepted_length
    assert stats["exact"] > 2 * stats["none"] and stats["edited"] > 1.5 * stats["none"], stats


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=4, max_size=60), st.integers(1, 3), st.integers(1, 12))
def test_vectorised_runs_equal_the_walk_capped(tokens: list[int], n: int, cap: int) -> None:
    """_runs (every occurrence at once, for a prediction full of repeats) is match_length capped at ``cap``."""
    import numpy as np

    from treedraft.drafters.prompt_lookup import _runs

    L = len(tokens)
    n = min(n, L - 1)
    cap = max(cap, n)
    starts = [s for s in range(L - n) if tokens[s : s + n] == tokens[L - n :]]
    if starts:
        got = _runs(np.asarray(tokens), starts, n, cap).tolist()
        assert got == [min(cap, PromptLookupDrafter.match_length(tokens, s, n)) for s in starts]


def test_a_repetitive_prediction_and_context_stay_cheap() -> None:
    """A 6-token loop over 4,000 tokens of context and 8,000 of prediction: every occurrence's run is measured in
    one array pass (the Python walk per occurrence took 0.2-1.2 s a step); the proposal still follows the loop."""
    loop = [11, 12, 13, 14, 15, 16]
    tokens = loop * 667
    tree = PromptLookupDrafter().propose(DraftContext(tokens, None, 16, 12, 2, reference=tuple(loop * 1334)))
    assert tree.tokens[1:4] == (11, 12, 13)


def test_a_prediction_may_be_text_ids_or_an_array_of_ids() -> None:
    import os
    import sys

    import numpy as np

    sys.path.insert(0, os.path.dirname(__file__))
    from server_utils import tiny_llm

    llm = tiny_llm()
    ids = (65, 66)  # "a", "b" for the tests' character tokenizer
    assert llm.prediction_ids("ab") == llm.prediction_ids(list(ids)) == llm.prediction_ids(np.array(ids)) == ids
    assert llm.prediction_ids(None) == () and llm.prediction_ids("") == ()
    for bad in ([1.5], [-1], [96], b"\x01", [True], 7, np.int64(5)):
        with pytest.raises(GenerationError, match="prediction must be"):
            llm.prediction_ids(bad)
