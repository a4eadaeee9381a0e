"""Per-token log-probabilities (GenerationConfig.logprobs): values, alignment with the tokens, and speculative
runs reporting exactly what plain decoding reports."""

from __future__ import annotations

import pytest
import torch
from native_utils import tiny_native

from treedraft import kernels
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import GenerationError
from treedraft.logprobs import MAX_TOP_LOGPROBS, prompt_logprobs, token_logprobs
from treedraft.sampling import SamplingParams
from treedraft.text import TextGenerator

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 1, 2]


@pytest.fixture(scope="module")
def native_gen() -> TextGenerator:
    if not kernels.available():
        pytest.skip(f"native kernel unavailable: {kernels.unavailable_reason()}")
    return TextGenerator(Engine(tiny_native(256, seed=3)))


@pytest.mark.parametrize("top", [0, 1, 5])
def test_token_logprobs_are_the_rows_log_softmax(top: int) -> None:
    g = torch.Generator().manual_seed(top)
    logits = torch.randn(4, 300, generator=g) * 5
    tokens = [7, 0, 299, int(logits[3].argmax())]
    out = token_logprobs(logits, tokens, top)
    ref = logits.double().log_softmax(-1)
    for r, lp in enumerate(out):
        assert lp.token_id == tokens[r]
        assert abs(lp.logprob - float(ref[r, tokens[r]])) < 1e-5
        best = ref[r].topk(top)
        assert [i for i, _ in lp.top] == best.indices.tolist()
        assert all(abs(v - float(w)) < 1e-5 for (_, v), w in zip(lp.top, best.values, strict=True))
    assert out[3].top[:1] == ((tokens[3], out[3].logprob),) or top == 0


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, True, 2.0])
def test_a_bad_logprobs_count_is_refused(bad) -> None:
    with pytest.raises(GenerationError, match="logprobs"):
        GenerationConfig(logprobs=bad)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(1.2, top_p=0.9, seed=5)], ids=["greedy", "seeded"]
)
def test_speculative_logprobs_equal_plain_and_follow_the_tokens(native_gen: TextGenerator, sampling) -> None:
    cfg = GenerationConfig(max_new_tokens=24, sampling=sampling, logprobs=3, ignore_eos=True)
    plain = native_gen.generate(PROMPT, cfg, None)
    spec = native_gen.generate(PROMPT, cfg, PromptLookupDrafter())
    assert spec.stats.mean_accepted_length > 1.0  # drafts were accepted: tree rows gave values
    assert spec.token_ids == plain.token_ids
    assert spec.logprobs == plain.logprobs  # the native rows are bitwise the plain ones
    assert [lp.token_id for lp in plain.logprobs] == plain.token_ids
    # each value is the log-softmax of the row that predicted its token: recompute the whole sequence at once
    model = native_gen.engine.model
    seq = PROMPT + plain.token_ids
    with torch.inference_mode():
        logits, _ = model.forward(torch.tensor([seq]), torch.arange(len(seq)), None, 0)
    ref = logits[0].double().log_softmax(-1)
    for i, lp in enumerate(plain.logprobs):
        row = len(PROMPT) - 1 + i
        assert abs(lp.logprob - float(ref[row, lp.token_id])) < 1e-3, i
        if sampling.greedy:
            assert lp.top[0][0] == lp.token_id


def test_logprobs_are_off_unless_asked(native_gen: TextGenerator) -> None:
    r = native_gen.generate(PROMPT, GenerationConfig(max_new_tokens=4), PromptLookupDrafter())
    assert r.logprobs is None
    chunks = list(native_gen.stream(PROMPT, GenerationConfig(max_new_tokens=4, logprobs=0), None))
    assert all(len(c.logprobs) == len(c.token_ids) == 1 and c.logprobs[0].top == () for c in chunks)
    assert [c.logprobs[0].token_id for c in chunks] == [t for c in chunks for t in c.token_ids]


def test_prompt_logprobs_in_chunks_equal_a_whole_prompt_forward(native_gen: TextGenerator) -> None:
    model = native_gen.engine.model
    ids = [(7 * i + 3) % 60 for i in range(150)]
    got = prompt_logprobs(model, ids, 2, chunk=64)  # three chunks: 64, 64, 21 rows
    with torch.inference_mode():
        logits, _ = model.forward(torch.tensor([ids]), torch.arange(len(ids)), None, 0)
    ref = logits[0].double().log_softmax(-1)
    assert [x.token_id for x in got] == ids and got[0].logprob is None and got[0].top == ()
    for j in range(1, len(ids)):
        assert abs(got[j].logprob - float(ref[j - 1, ids[j]])) < 1e-3, j
        assert got[j].top[0][0] == int(ref[j - 1].argmax())


def test_token_logprobs_never_load_the_native_kernel(monkeypatch) -> None:
    """Asking for logprobs must not build or load the kernel: that would also switch the process's sampling to
    the native path (other rounding) from then on. Not loaded: the NumPy path gives the same values."""
    monkeypatch.setattr(kernels, "loaded_extension", lambda: None)
    monkeypatch.setattr(kernels, "_ext", lambda: pytest.fail("token_logprobs loaded the native kernel"))
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(9))
    out = token_logprobs(logits, [3, 4], 2)
    ref = logits.double().log_softmax(-1)
    for r, (x, t) in enumerate(zip(out, [3, 4], strict=True)):
        assert abs(x.logprob - float(ref[r, t])) < 1e-6


def test_more_top_logprobs_than_the_vocabulary_gives_all_of_it() -> None:
    from treedraft.models.tiny import tiny_llama

    r = Engine(tiny_llama(vocab_size=8)).generate([1, 2, 3], GenerationConfig(max_new_tokens=4, logprobs=20), None)
    assert len(r.token_ids) == 4 and len(r.logprobs) == 4
    for lp in r.logprobs:
        assert sorted(i for i, _ in lp.top) == list(range(8))  # every token, each once
