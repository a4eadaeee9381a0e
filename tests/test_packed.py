"""Transformer.forward_packed: several requests' rows in one forward, attention per request's own cache.

Float (SDPA, MKL linears): packed equals per-request forward within rounding. Native linears + exact
attention: every row is bitwise the same alone or packed, whatever the other requests' rows.
"""

from __future__ import annotations

import pytest
import torch
from spec_stats import one_thread  # noqa: F401

from treedraft import kernels
from treedraft.models.llama import Segment, Transformer
from treedraft.models.tiny import tiny_llama
from treedraft.tree import TokenTree, full_attention_mask, tree_positions

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_native() -> Transformer:
    """A tiny seeded model with every linear a native q4 linear (exact attention switched on)."""
    from native_utils import tiny_native

    return tiny_native(max_seq_len=96)


def _prefilled(model: Transformer, prompt: list[int]):
    cache = model.new_cache(96)
    model.forward(torch.tensor([prompt]), torch.arange(len(prompt)), cache, 0)
    cache.keep(0, range(len(prompt)))
    return cache


TREE = TokenTree((5, 1, 2, 3, 4, 6), (-1, 0, 0, 1, 1, 3))  # root, two children, grandchildren, one deeper


def _cases(g: torch.Generator) -> list[tuple[list[int], TokenTree | None]]:
    """(prompt, tree) per request; tree None = a 7-token causal chunk (chunked prefill continuing)."""
    out = []
    for n, tree in ((9, TREE), (4, None), (13, TokenTree((7,), (-1,))), (6, TREE)):
        out.append(([int(t) for t in torch.randint(0, 64, (n,), generator=g)], tree))
    return out


def _alone(model: Transformer, prompt: list[int], tree: TokenTree | None) -> tuple[Tensor, Tensor, list[int]]:
    """One request through forward_packed on its own: (logits, hidden, tokens)."""
    cache = _prefilled(model, prompt)
    start = cache.length
    if tree is None:
        toks = list(range(10, 17))
        seg = Segment(cache, start, len(toks), None)
        pos = torch.arange(start, start + len(toks))
    else:
        toks = list(tree.tokens)
        seg = Segment(cache, start, len(tree), None if len(tree) == 1 else full_attention_mask(tree, start, "cpu"))
        pos = tree_positions(tree, start, "cpu")
    logits, hidden = model.forward_packed(torch.tensor(toks), pos, [seg])
    return logits, hidden, toks


def _forward_alone(model: Transformer, prompt: list[int], tree: TokenTree | None, toks: list[int]):
    """The same request through the plain Transformer.forward: (logits (1, T, V), hidden (1, T, H))."""
    cache = _prefilled(model, prompt)
    start = cache.length
    if tree is None:
        return model.forward(torch.tensor([toks]), torch.arange(start, start + len(toks)), cache, start)
    mask = None if len(tree) == 1 else full_attention_mask(tree, start, "cpu")
    return model.forward(torch.tensor([toks]), tree_positions(tree, start, "cpu"), cache, start, mask)


Tensor = torch.Tensor


def _packed(model: Transformer, cases) -> tuple[Tensor, Tensor, list[int]]:
    """All requests in one forward_packed; returns (logits, hidden, rows per request)."""
    segs, toks, pos, rows = [], [], [], []
    for prompt, tree in cases:
        cache = _prefilled(model, prompt)
        start = cache.length
        if tree is None:
            t = list(range(10, 17))
            segs.append(Segment(cache, start, len(t), None))
            pos.append(torch.arange(start, start + len(t)))
        else:
            t = list(tree.tokens)
            m = None if len(tree) == 1 else full_attention_mask(tree, start, "cpu")
            segs.append(Segment(cache, start, len(t), m))
            pos.append(tree_positions(tree, start, "cpu"))
        toks += t
        rows.append(len(t))
    logits, hidden = model.forward_packed(torch.tensor(toks), torch.cat(pos), segs)
    return logits, hidden, rows


@torch.inference_mode()
def test_one_segment_equals_forward() -> None:
    """The one-segment case is the plain forward (tree mask, causal chunk, single token)."""
    model = tiny_llama(seed=1, vocab_size=64, max_seq_len=96)
    g = torch.Generator().manual_seed(0)
    for prompt, tree in _cases(g):
        logits, hidden, toks = _alone(model, prompt, tree)
        ref = _forward_alone(model, prompt, tree, toks)
        torch.testing.assert_close(logits, ref[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden, ref[1][0], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_packed_equals_alone_float() -> None:
    """Float model: each request's rows packed with others equal its rows alone (within rounding)."""
    model = tiny_llama(seed=2, vocab_size=64, max_seq_len=96)
    cases = _cases(torch.Generator().manual_seed(1))
    logits, hidden, rows = _packed(model, cases)
    r0 = 0
    for (prompt, tree), n in zip(cases, rows):
        la, ha, _ = _alone(model, prompt, tree)
        torch.testing.assert_close(logits[r0 : r0 + n], la, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[r0 : r0 + n], ha, atol=1e-5, rtol=1e-5)
        r0 += n


@torch.inference_mode()
def test_packed_writes_each_cache_like_alone() -> None:
    """Each request's cache gets its own rows' keys/values (none of another request's)."""
    model = tiny_llama(seed=3, vocab_size=64, max_seq_len=96)
    cases = _cases(torch.Generator().manual_seed(2))
    caches = [_prefilled(model, p) for p, _ in cases]
    segs, toks, pos = [], [], []
    for (_prompt, tree), c in zip(cases, caches):
        t = list(range(10, 17)) if tree is None else list(tree.tokens)
        m = None if tree is None or len(tree) == 1 else full_attention_mask(tree, c.length, "cpu")
        segs.append(Segment(c, c.length, len(t), m))
        pos.append(torch.arange(c.length, c.length + len(t)) if tree is None else tree_positions(tree, c.length, "cpu"))
        toks += t
    model.forward_packed(torch.tensor(toks), torch.cat(pos), segs)
    for (prompt, tree), seg in zip(cases, segs):
        alone = _prefilled(model, prompt)
        _, _, t = _alone_into(model, alone, tree)
        end = seg.start + seg.rows
        torch.testing.assert_close(seg.cache.k[1][:, :, :end], alone.k[1][:, :, :end], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(seg.cache.v[0][:, :, :end], alone.v[0][:, :, :end], atol=1e-5, rtol=1e-5)


def _alone_into(model, cache, tree):
    start = cache.length
    toks = list(range(10, 17)) if tree is None else list(tree.tokens)
    m = None if tree is None or len(tree) == 1 else full_attention_mask(tree, start, "cpu")
    pos = torch.arange(start, start + len(toks)) if tree is None else tree_positions(tree, start, "cpu")
    return (*model.forward_packed(torch.tensor(toks), pos, [Segment(cache, start, len(toks), m)]), toks)


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
@torch.inference_mode()
def test_packed_is_bitwise_alone_with_native_linears() -> None:
    """Native linears + exact attention: every row is bitwise the same alone or packed (any other rows)."""
    model = _tiny_native()
    assert model.exact_attention
    cases = _cases(torch.Generator().manual_seed(3))
    logits, hidden, rows = _packed(model, cases)
    r0 = 0
    for (prompt, tree), n in zip(cases, rows):
        la, ha, _ = _alone(model, prompt, tree)
        assert torch.equal(logits[r0 : r0 + n], la)
        assert torch.equal(hidden[r0 : r0 + n], ha)
        r0 += n
    # and in another order with another mix (the row offsets of each request change)
    logits2, _, rows2 = _packed(model, cases[::-1][:3])
    la, _, _ = _alone(model, *cases[-1])
    assert torch.equal(logits2[: rows2[0]], la)


@torch.inference_mode()
def test_logits_for_and_bad_arguments() -> None:
    model = tiny_llama(seed=4, vocab_size=64, max_seq_len=96)
    cache = model.new_cache(32)
    toks, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    full, _ = model.forward_packed(toks, pos, [Segment(cache, 0, 3, None)])
    cache2 = model.new_cache(32)
    last, h = model.forward_packed(toks, pos, [Segment(cache2, 0, 3, None)], logits_for=torch.tensor([2]))
    assert last.shape == (1, 64) and h.shape == (3, 32)
    torch.testing.assert_close(last[0], full[2])
    with pytest.raises(ValueError, match="segments cover 2 rows"):
        model.forward_packed(toks, pos, [Segment(cache, 0, 2, None)])
    with pytest.raises(ValueError, match="expected \\(3, 3\\)"):
        model.forward_packed(toks, pos, [Segment(cache, 0, 3, torch.ones(3, 4, dtype=torch.bool))])
    with pytest.raises(ValueError, match="shape \\(M,\\)"):
        model.forward_packed(toks[None], pos, [Segment(cache, 0, 3, None)])


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
@torch.inference_mode()
def test_one_segment_is_bitwise_forward_with_native_linears() -> None:
    """Native + exact attention: the packed one-segment path gives forward's bits (tree, chunk, one token)."""
    model = _tiny_native()
    for prompt, tree in _cases(torch.Generator().manual_seed(4)):
        logits, hidden, toks = _alone(model, prompt, tree)
        ref = _forward_alone(model, prompt, tree, toks)
        assert torch.equal(logits, ref[0][0]) and torch.equal(hidden, ref[1][0])


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
@torch.inference_mode()
def test_prefill_segment_in_a_batch_leaves_decode_rows_bitwise_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A joining request's first prefill chunk (start 0) in the batch: the decode-step segments still take the
    fused native path they take alone (bitwise), the prefill rows the path they take alone, logits_for maps back."""
    import treedraft.models.fused as fused

    model = _tiny_native()
    calls = []
    real = fused.forward_segments
    monkeypatch.setattr(fused, "forward_segments", lambda m, *a, **k: calls.append(len(a[2])) or real(m, *a, **k))
    cases = _cases(torch.Generator().manual_seed(5))[:2]
    alone = [_alone(model, p, t) for p, t in cases]
    fresh = [int(t) for t in torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(6))]
    ref_prefill = model.forward_packed(torch.tensor(fresh), torch.arange(5), [Segment(model.new_cache(96), 0, 5, None)])
    segs, toks, pos = [], [], []
    for (prompt, tree), (_, _, t) in zip(cases, alone):
        cache = _prefilled(model, prompt)
        start = cache.length
        m = None if tree is None or len(tree) == 1 else full_attention_mask(tree, start, "cpu")
        segs.append(Segment(cache, start, len(t), m))
        pos.append(torch.arange(start, start + len(t)) if tree is None else tree_positions(tree, start, "cpu"))
        toks += t
    segs.insert(1, Segment(model.new_cache(96), 0, 5, None))  # the prefill sits between the two decode segments
    pos.insert(1, torch.arange(5))
    n0 = len(alone[0][2])
    toks = toks[:n0] + fresh + toks[n0:]
    calls.clear()
    want = torch.tensor([n0 + 4, 0, n0 + 5])  # last prefill row, first row of request 0, first row of request 2
    logits, hidden = model.forward_packed(torch.tensor(toks), torch.cat(pos), segs, want)
    assert calls == [2]  # the two decode segments went native together, the prefill did not
    assert torch.equal(hidden[:n0], alone[0][1]) and torch.equal(hidden[n0 + 5 :], alone[1][1])
    assert torch.equal(hidden[n0 : n0 + 5], ref_prefill[1])
    assert torch.equal(logits[0], ref_prefill[0][4]) and torch.equal(logits[1], alone[0][0][0])
    assert torch.equal(logits[2], alone[1][0][0])
