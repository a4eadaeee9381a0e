"""Per-token log-probabilities of generated tokens (the OpenAI ``logprobs`` / ``top_logprobs`` fields).

A token's log-probability is read from the verify row that predicted it: the target's own logits at that
position, the rows of a tree step being bitwise those plain decoding computes (attn.h, mm_core.h), so a
speculative run reports the same values as a plain one. The distribution is the model's own: log-softmax of
its logits, before temperature, top-k and top-p (as vLLM's default), so the values do not depend on the
sampling settings, and a greedy token's is its row's largest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its id, log p(token), and the ``top`` most likely (id, log p), best first. ``logprob`` None: a
    prompt's first token, which nothing predicts (:func:`prompt_logprobs`)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


class Committed(list):
    """A step's committed token ids (a plain list), with ``logprobs`` parallel to them when the request asked
    for them (``GenerationConfig.logprobs``), else None."""

    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, tokens: Sequence[int], logprobs: list[TokenLogprob] | None = None) -> Committed:
        """``tokens`` as a Committed list carrying ``logprobs``."""
        out = cls(tokens)
        out.logprobs = logprobs
        return out


def check_top(n: int | None) -> None:
    """ValueError unless ``n`` is None (no logprobs) or an int in [0, MAX_TOP_LOGPROBS]."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"logprobs must be None (off) or the number of top alternatives per token, 0..{MAX_TOP_LOGPROBS}; got {n!r}"
        )


def token_logprobs(logits: Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row r of ``logits`` (R, V) predicted ``tokens[r]``: its log-softmax value and the row's ``top`` best.

    One native pass per row when the kernel is loaded (kernels.topk_rows: k best + logsumexp in float64 over
    float32 exponentials), else NumPy; the chosen token's value is its logit minus the same logsumexp (the
    identical value when it is among the ``top``).
    """
    from . import kernels

    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"token_logprobs: need one (V,) row per token, got {tuple(logits.shape)} for {len(tokens)}")
    check_top(top)
    rows = logits.detach().to("cpu", torch.float32)
    # load=False: asking for logprobs must not build or load the native kernel (which would also switch this
    # process's sampling to the native path mid-way: the same seeded request could then round differently)
    # (a vocabulary smaller than ``top``, a toy or callable target's: all of it)
    vals, ids = kernels.topk_rows(rows, max(1, min(top, rows.shape[1])), log_softmax=True, load=False)
    out = []
    for r, tok in enumerate(tokens):
        best = tuple((int(i), float(v)) for i, v in zip(ids[r, :top], vals[r, :top], strict=True))
        lp = dict(best).get(int(tok))  # a token among the best: the very same value
        if lp is None:
            lse = float(rows[r, int(ids[r, 0])]) - float(vals[r, 0])  # the best logit minus its log-softmax value
            lp = float(rows[r, int(tok)]) - lse
        out.append(TokenLogprob(int(tok), lp, best))
    return out


def prompt_logprobs(model, ids: Sequence[int], top: int, chunk: int = 64) -> list[TokenLogprob]:
    """Each prompt token's log-probability given the tokens before it, with its position's ``top`` best (the first
    token's: None, nothing predicts it): one forward over the prompt in chunks of ``chunk`` rows on a scratch
    cache (what a completions request with ``echo`` and ``logprobs`` reports, e.g. to score a text)."""
    check_top(top)
    out = [TokenLogprob(int(ids[0]), None)] if len(ids) else []
    if len(ids) < 2:
        return out
    from .interfaces import target_device

    dev = target_device(model)
    cache = model.new_cache(len(ids))
    with torch.inference_mode():
        for c0 in range(0, len(ids) - 1, chunk):
            c1 = min(len(ids) - 1, c0 + chunk)  # rows c0..c1-1 predict tokens c0+1..c1
            toks, pos = torch.tensor([list(ids[c0:c1])], device=dev), torch.arange(c0, c1, device=dev)
            logits, _ = model.forward(toks, pos, cache, c0)
            cache.keep(c0, range(c1 - c0))
            out += token_logprobs(logits[0], ids[c0 + 1 : c1 + 1], top)
    return out
