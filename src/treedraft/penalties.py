"""Logit bias and repetition, presence and frequency penalties over a tree's rows, exactly as plain decoding
applies them.

The target distribution of a penalised request is the model's logits adjusted by what came before the
predicted position (vLLM's order and semantics):

- ``bias`` (OpenAI's ``logit_bias``): a fixed amount added to given tokens' logits at every position, first;

- ``repetition`` r (Keskar et al. 2019, CTRL; Hugging Face's ``repetition_penalty``): every token present in
  the prompt or the output so far has its logit divided by r where positive, multiplied by r where not;
- ``frequency`` f and ``presence`` p (OpenAI's): a token that occurs c > 0 times in the output so far loses
  f * c + p from its logit;
- ``min_tokens`` m (vLLM's): the EOS ids get -inf wherever the output so far is shorter than m tokens.

A tree row's "so far" is the committed tokens plus the tokens on its own path from the root, so each row
is adjusted as plain decoding would adjust that very position: speculative output stays the plain
(penalised) output token for token, and sampling stays lossless for the penalised distribution. Only the
tokens seen appear in the adjustment, so a step touches (rows x distinct tokens seen) logits, in place; the
returned undo puts the model's own values back (reported logprobs are the model's, before penalties, as
they are before temperature and top-p).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

PENALTY_RANGE = 2.0  # |presence|, |frequency| at most this (OpenAI's range)
BIAS_RANGE = 100.0  # |logit_bias| values at most this (OpenAI's range)
# repetition within [1/this, this]: a factor past it only saturates the choice, and near float32's limits the
# division overflows (1e-40 made every positive logit inf, so sampling had no mass left)
REPETITION_RANGE = 100.0


@dataclass(frozen=True)
class Penalties:
    """repetition 1.0, presence 0.0, frequency 0.0, no bias and min_tokens 0 are off. ``bias``: (token id, amount)
    pairs. ``min_tokens``: the ``stop_ids`` (EOS) are banned until the output holds that many tokens (vLLM's)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (1 / REPETITION_RANGE <= self.repetition <= REPETITION_RANGE):
            raise ValueError(
                f"repetition_penalty must be in [{1 / REPETITION_RANGE:g}, {REPETITION_RANGE:g}] (1.0 is off), "
                f"got {self.repetition}"
            )
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
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def active(self) -> bool:
        penal = self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0
        return penal or bool(self.bias) or (self.min_tokens > 0 and bool(self.stop_ids))

    def check_vocab(self, vocab: int) -> None:
        """ValueError unless every biased token id is below ``vocab``."""
        bad = [t for t, _ in self.bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside this model's vocabulary (0..{vocab - 1})")


class PenaltyState:
    """What a request's adjustments depend on, kept as slots over the tokens that matter (biased ones, the prompt's
    when the repetition penalty is on, the output's, and draft tokens once they appeared on a path): their ids,
    output counts, whether the prompt holds them, and their bias. Updated per committed token in NumPy, read per
    step as tensors without copies: a step touches (rows x slots) logits, whatever the vocabulary."""

    def __init__(self, pen: Penalties, prompt: Iterable[int]) -> None:
        self.pen = pen
        self.penal = pen.repetition != 1.0 or pen.presence != 0.0 or pen.frequency != 0.0
        self.n_out = 0  # output tokens committed (min_tokens)
        self.slot: dict[int, int] = {}
        self.n = 0
        self.ids = np.zeros(64, np.int64)
        self.counts = np.zeros(64, np.float32)
        self.in_prompt = np.zeros(64, np.bool_)
        self.bias = np.zeros(64, np.float32)
        for t, b in pen.bias:
            k = self._slot(int(t))  # first: a slot may grow the arrays
            self.bias[k] = b
        if pen.repetition != 1.0:
            for t in set(prompt):
                k = self._slot(int(t))
                self.in_prompt[k] = True

    def _slot(self, t: int) -> int:
        k = self.slot.get(t)
        if k is None:
            if self.n == len(self.ids):
                for name in ("ids", "counts", "in_prompt", "bias"):
                    a = getattr(self, name)
                    setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
            k = self.slot[t] = self.n
            self.ids[k] = t
            self.n += 1
        return k

    def add(self, tokens: Sequence[int]) -> None:
        """Count newly committed output tokens."""
        self.n_out += len(tokens)
        if self.penal:
            for t in tokens:
                k = self._slot(int(t))
                self.counts[k] += 1.0


def _noop() -> None:
    return None


def penalize_(logits: Tensor, state: PenaltyState, paths: Sequence[Sequence[int]]) -> Callable[[], None]:
    """Adjust ``logits`` (N, V) in place: row r as plain decoding would after the committed tokens and then
    ``paths[r]`` (the draft tokens on row r's path below the root; ``[]`` for the root's row). Returns a
    function that restores the model's values (the (N, slots) block is computed in NumPy: :func:`_columns`)."""
    pen = state.pen
    if not pen.active:
        return _noop
    undo_slots = _adjust_slots(logits, state, paths)
    banned = [r for r, p in enumerate(paths) if state.n_out + len(p) < pen.min_tokens] if pen.stop_ids else []
    if not banned:
        return undo_slots
    at = (torch.tensor(banned, device=logits.device)[:, None], torch.tensor(pen.stop_ids, device=logits.device))
    kept = logits[at]  # rows whose output would still be shorter than min_tokens: no EOS there
    logits[at] = float("-inf")

    def undo() -> None:
        logits[at] = kept  # first: the slots' values below are from before the ban
        undo_slots()

    return undo


def _adjust_slots(logits: Tensor, state: PenaltyState, paths: Sequence[Sequence[int]]) -> Callable[[], None]:
    """The bias and penalties part of :func:`penalize_` (the request's token slots)."""
    pen = state.pen
    n, rows = state.n, logits.shape[0]
    cells, extra = [], {}  # (row, column); draft tokens not among the slots: this step's own columns after them
    if state.penal:
        for r, p in enumerate(paths):
            for t in p:
                t = int(t)
                k = state.slot.get(t)
                if k is None:
                    k = extra.setdefault(t, n + len(extra))
                cells.append((r, k))
    if n + len(extra) == 0:
        return _noop
    ids, in_prompt, bias, base = state.ids[:n], state.in_prompt[:n], state.bias[:n], state.counts[:n]
    if extra:  # a rejected draft token must not keep a column for the rest of the request
        m = len(extra)
        ids = np.concatenate([ids, np.fromiter(extra, np.int64, m)])
        in_prompt = np.concatenate([in_prompt, np.zeros(m, np.bool_)])
        bias, base = np.concatenate([bias, np.zeros(m, np.float32)]), np.concatenate([base, np.zeros(m, np.float32)])
    orig, put = _columns(logits, ids)
    counts = np.broadcast_to(base, (rows, len(ids)))
    if cells:
        counts = counts.copy()
        r, k = zip(*cells, strict=True)
        np.add.at(counts, (np.asarray(r), np.asarray(k)), 1.0)
    put(_adjusted(orig, pen, counts, in_prompt, bias))
    return lambda: put(orig)


def _columns(logits: Tensor, cols: np.ndarray) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:
    """Columns ``cols`` of ``logits`` (N, V) as a float32 NumPy copy, and a function writing such a block back. A
    float32 CPU tensor goes through its NumPy view (a step's few small ops cost microseconds there, tens in torch),
    any other through torch indexing."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        view = logits.detach().numpy()

        def put(block: np.ndarray) -> None:
            view[:, cols] = block

        return view[:, cols], put  # fancy indexing: a copy
    idx = torch.from_numpy(cols).to(logits.device)

    def put_tensor(block: np.ndarray) -> None:
        logits[:, idx] = torch.from_numpy(block).to(logits.device, logits.dtype)

    return logits[:, idx].float().cpu().numpy(), put_tensor


def _adjusted(vals: np.ndarray, pen: Penalties, counts: np.ndarray, in_prompt: np.ndarray, bias: np.ndarray):
    """(rows, slots) logits -> adjusted (a new float32 array): bias, then repetition, then frequency / presence."""
    vals = vals + bias if pen.bias else vals.copy()
    if pen.repetition != 1.0:
        hit = in_prompt | (counts > 0)
        r = np.float32(pen.repetition)
        vals = np.where(hit, np.where(vals > 0, vals / r, vals * r), vals)
    if pen.frequency != 0.0 or pen.presence != 0.0:
        vals = vals - np.float32(pen.frequency) * counts - np.float32(pen.presence) * (counts > 0)
    return vals.astype(np.float32, copy=False)


def penalize_draft_(logits: Tensor, state: PenaltyState, cols: np.ndarray | None = None) -> None:
    """Adjust a drafter's logits (D, V') in place by the request's bias and repetition penalty as the target's
    next row will be (the committed tokens; the draft paths below are not known yet), so that its candidates
    follow the penalised target. ``cols``: each target token id's column in V' (-1: not in the draft
    vocabulary); None when V' is the vocabulary. Only draft quality depends on this: verification applies the
    exact penalties.

    Frequency and presence penalties are left out: they subtract absolute amounts, and the heads' logits are
    flatter than the target's, so the same amount overturns the heads' choices more often than the target's.
    Measured with the shipped heads (``benchmarks/penalties_ab.py --drafter medusa``, 6 MT-Bench first turns x
    128, session 24): depth-1 acceptance with frequency 0.5 fell from 0.339 to 0.303 when adjusted, presence 0.5
    stayed 0.348; the repetition penalty's division is relative to the logit's own size, and adjusting for it
    raised the acceptance from 0.139 to 0.167 (1.3) and from 0.308 to 0.319 (1.1)."""
    pen, n = state.pen, state.n
    if (pen.repetition == 1.0 and not pen.bias) or n == 0:
        return
    pen = dataclasses.replace(pen, presence=0.0, frequency=0.0)
    ids = state.ids[:n]
    if cols is None:
        sel = np.arange(n)
    else:  # ids past the map's end are not in the draft vocabulary either
        sel = np.flatnonzero((ids < len(cols)) & (cols[np.minimum(ids, len(cols) - 1)] >= 0))
    if len(sel) == 0:
        return
    block, put = _columns(logits, ids[sel] if cols is None else cols[ids[sel]])
    counts = np.broadcast_to(state.counts[sel], block.shape)
    put(_adjusted(block, pen, counts, state.in_prompt[sel], state.bias[sel]))
