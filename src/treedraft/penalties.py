"""Logit bias and repetition, presence and frequency penalties over a tree's rows, exactly as plain decoding
applies them.

The target distribution of a penalised request is the model's logits adjusted by what came before the
predicted position (vLLM's order and semantics):

- ``bias`` (OpenAI's ``logit_bias``): a fixed amount added to given tokens' logits at every position, first;

- ``repetition`` r (Keskar et al. 2019, CTRL; Hugging Face's ``repetition_penalty``): every token present in
  the prompt or the output so far has its logit divided by r where positive, multiplied by r where not;
- ``frequency`` f and ``presence`` p (OpenAI's): a token that occurs c > 0 times in the output so far loses
  f * c + p from its logit.

A tree row's "so far" is the committed tokens plus the tokens on its own path from the root, so each row
is adjusted as plain decoding would adjust that very position: speculative output stays the plain
(penalised) output token for token, and sampling stays lossless for the penalised distribution. Only the
tokens seen appear in the adjustment, so a step touches (rows x distinct tokens seen) logits, in place; the
returned undo puts the model's own values back (reported logprobs are the model's, before penalties, as
they are before temperature and top-p).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PENALTY_RANGE = 2.0  # |presence|, |frequency| at most this (OpenAI's range)
BIAS_RANGE = 100.0  # |logit_bias| values at most this (OpenAI's range)


@dataclass(frozen=True)
class Penalties:
    """repetition 1.0, presence 0.0, frequency 0.0 and no bias are off. ``bias``: (token id, amount) pairs."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.repetition > 0.0) or self.repetition == float("inf"):
            raise ValueError(f"repetition_penalty must be a positive number (1.0 is off), got {self.repetition}")
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (-PENALTY_RANGE <= v <= PENALTY_RANGE):
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE}, {PENALTY_RANGE}] (0 is off), got {v}")
        ids = [t for t, _ in self.bias]
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias names a token more than once")
        for t, v in self.bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not (-BIAS_RANGE <= v <= BIAS_RANGE):
                raise ValueError(f"logit_bias values must be in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {v} for {t}")

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0 or bool(self.bias)

    def check_vocab(self, vocab: int) -> None:
        """ValueError unless every biased token id is below ``vocab``."""
        bad = [t for t, _ in self.bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside this model's vocabulary (0..{vocab - 1})")


class PenaltyState:
    """What a request's penalties depend on: the prompt's distinct tokens and the output's token counts."""

    def __init__(self, prompt: Iterable[int]) -> None:
        self.prompt = frozenset(int(t) for t in prompt)
        self.counts: Counter[int] = Counter()

    def add(self, tokens: Iterable[int]) -> None:
        """Count newly committed output tokens."""
        self.counts.update(int(t) for t in tokens)


def _noop() -> None:
    return None


def penalize_(
    logits: Tensor, pen: Penalties, state: PenaltyState, paths: Sequence[Sequence[int]]
) -> Callable[[], None]:
    """Adjust ``logits`` (N, V) in place: row r as plain decoding would after the committed tokens and then
    ``paths[r]`` (the draft tokens on row r's path below the root; ``[]`` for the root's row). Returns a
    function that restores the model's values."""
    if not pen.active:
        return _noop
    penal = pen.repetition != 1.0 or pen.presence != 0.0 or pen.frequency != 0.0
    seen = set()
    if penal:
        seen = set(state.counts) | {int(t) for p in paths for t in p}
    if pen.repetition != 1.0:
        seen |= state.prompt
    bias = dict(pen.bias)
    if not seen and not bias:
        return _noop
    ids = sorted(seen | set(bias))
    at = {t: k for k, t in enumerate(ids)}
    n = logits.shape[0]
    counts = torch.tensor([state.counts.get(t, 0) for t in ids], dtype=torch.float32)
    counts = counts.expand(n, len(ids)).clone()
    for r, path in enumerate(paths if penal else ()):
        for t in path:
            counts[r, at[int(t)]] += 1.0
    idx = torch.tensor(ids, dtype=torch.long, device=logits.device)
    orig = logits[:, idx]  # advanced indexing: a copy
    vals = orig.float()
    if bias:
        vals = vals + torch.tensor([bias.get(t, 0.0) for t in ids], dtype=torch.float32, device=logits.device)
    if pen.repetition != 1.0:
        in_prompt = torch.tensor([t in state.prompt for t in ids], dtype=torch.bool)  # (bias-only ids: counts 0)
        hit = (in_prompt.expand(n, len(ids)) | (counts > 0)).to(logits.device)
        vals = torch.where(hit, torch.where(vals > 0, vals / pen.repetition, vals * pen.repetition), vals)
    if pen.frequency != 0.0 or pen.presence != 0.0:
        c = counts.to(logits.device)
        vals = vals - pen.frequency * c - pen.presence * (c > 0).float()
    logits[:, idx] = vals.to(logits.dtype)

    def undo() -> None:
        logits[:, idx] = orig

    return undo


def tree_paths(parents: Sequence[int]) -> list[list[int]]:
    """For each node of a tree (``parents[i]`` < i, the root's -1): its path's node indices below the root, in
    order (the root's: empty)."""
    out: list[list[int]] = []
    for i, p in enumerate(parents):
        out.append([] if p < 0 else out[p] + [i])
    return out
