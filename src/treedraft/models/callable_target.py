"""Model-agnostic target: any Python callable ``target(tokens) -> {token: prob}``.

Useful when the target is a black box (a remote service returning next-token
probabilities, a lookup table, a toy model in a test). :class:`CallableTarget`
implements the engine's target interface, so the very same decode loop and
acceptance rules run on it:

* ``forward`` returns, for every input position, log-probabilities as "logits"
  (``-inf`` for tokens the callable left out), so temperature / top-k / top-p and
  every acceptance rule apply unchanged (softmax(log p) == p at temperature 1);
* the positions of one call (the nodes of a draft tree) are evaluated concurrently
  in a :class:`~concurrent.futures.ThreadPoolExecutor`; each node's context is
  the committed tokens plus its own root-to-node path, read off the attention mask
  exactly as a transformer would;
* the "KV cache" is the list of tokens in its slots, with the same
  ``keep(start, indices)`` compaction as the real cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

TargetFn = Callable[[list[int]], Mapping[int, float]]


def token_id(t: object, who: str, vocab_size: int) -> int:
    """A callable's token key as an int: Python and NumPy integers (not bools, floats or tensors), in the
    vocabulary; ValueError naming ``who`` and what is wrong otherwise."""
    import numbers

    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise ValueError(f"{who} returned token {t!r} ({type(t).__name__}): token ids must be integers")
    if not 0 <= int(t) < vocab_size:
        raise ValueError(f"{who} returned token {int(t)} outside the vocabulary [0, {vocab_size})")
    return int(t)


class TokenCache:
    """Token ids per slot (the callable target's stand-in for a KV cache)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.slots: list[int] = []
        self.length = 0

    def write(self, start: int, tokens: Sequence[int]) -> None:
        """Put ``tokens`` into slots ``[start, start + len(tokens))``, forgetting later slots."""
        end = start + len(tokens)
        if end > self.max_len:
            raise ValueError(f"cache overflow: writing up to {end} > max_len {self.max_len}")
        if start > len(self.slots):
            raise ValueError(f"cannot write at slot {start}: only {len(self.slots)} slots are filled")
        self.slots[start:] = [int(t) for t in tokens]

    def keep(self, start: int, indices: Tensor | Sequence[int]) -> None:
        """Keep slots ``start + indices`` (in order) at ``start ...``; set length accordingly."""
        idx = [int(i) for i in (indices.tolist() if isinstance(indices, Tensor) else indices)]
        kept = [self.slots[start + i] for i in idx]
        self.slots[start:] = kept
        self.length = start + len(kept)

    def truncate(self, length: int) -> None:
        """Forget everything at or after ``length``."""
        self.length = min(self.length, length)
        del self.slots[self.length :]

    @property
    def tokens(self) -> list[int]:
        """The committed tokens."""
        return self.slots[: self.length]


class CallableTarget:
    """Engine target over ``fn(tokens) -> {token: prob}`` (probabilities are renormalised)."""

    def __init__(
        self, fn: TargetFn, vocab_size: int, max_seq_len: int = 4096, max_workers: int = 8, name: str | None = None
    ) -> None:
        if vocab_size < 1 or max_seq_len < 2 or max_workers < 1:
            raise ValueError(
                f"need vocab_size >= 1, max_seq_len >= 2 and max_workers >= 1, "
                f"got {vocab_size}, {max_seq_len}, {max_workers}"
            )
        self.fn = fn
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.hidden_size = 0  # no hidden states: forward returns None for them
        self.max_workers = max_workers
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def device(self) -> torch.device:
        """The engine builds this target's inputs on the CPU (the callable reads them as Python ints)."""
        return torch.device("cpu")

    def input_embedding_weight(self) -> None:
        """A callable has no embedding matrix (drafters that need one refuse this target)."""
        return None

    def output_projection_weight(self) -> None:
        """A callable has no output projection (drafters that need one refuse this target)."""
        return None

    # ---- lifecycle ------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="treedraft-target")
        return self._pool

    def close(self) -> None:
        """Shut the worker threads down (a later forward starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> CallableTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_cache(self, max_len: int | None = None) -> TokenCache:
        """An empty token cache of ``max_len`` slots (default: max_seq_len)."""
        return TokenCache(max_len or self.max_seq_len)

    # ---- the target interface -------------------------------------------
    def log_probs(self, context: list[int]) -> Tensor:
        """(V,) float32 log-probabilities of the next token after ``context`` (one call of fn)."""
        dist = self.fn(list(context))
        if not isinstance(dist, Mapping):
            raise TypeError(f"target {self.name!r} returned {type(dist).__name__}; expected a dict {{token: prob}}")
        out = torch.zeros(self.vocab_size, dtype=torch.float64)
        for t, p in dist.items():
            t = token_id(t, f"target {self.name!r}", self.vocab_size)
            p = float(p)
            if not (p >= 0.0 and math.isfinite(p)):
                raise ValueError(f"target {self.name!r} returned probability {p!r} for token {t}")
            out[t] += p
        total = float(out.sum())
        if total <= 0.0:
            raise ValueError(f"target {self.name!r} returned no probability mass for context of {len(context)} tokens")
        return (out / total).log().float()

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: TokenCache | None = None,
        start: int | None = None,
        mask: Tensor | None = None,
        logits_for: Tensor | slice | None = None,
    ) -> tuple[Tensor, None]:
        """Next-token log-probs for each new token, as the engine's ``model.forward``.

        tokens: (1, T) ids written to cache slots [start, start+T); mask: (T, start+T)
        bool, True = may attend (None = causal). Node i's context is every attended
        slot in order, i.e. committed prefix + its root-to-node path. Returns
        ((1, T', V) log-probs for the rows picked by ``logits_for``, None for hidden).
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.shape[0] != 1:
            raise ValueError("the callable target runs one sequence at a time (batch 1)")
        new = [int(t) for t in tokens[0].tolist()]
        T = len(new)
        if cache is None:
            cache = self.new_cache(max(T, 2))
            start = 0
        start = cache.length if start is None else start
        cache.write(start, new)
        slots = cache.slots  # (start + T,) token ids
        if mask is not None:
            mask = mask.reshape(T, start + T).tolist()
        rows = list(range(T))
        if logits_for is not None:
            rows = (
                rows[logits_for]
                if isinstance(logits_for, slice)
                else [rows[int(i)] for i in torch.as_tensor(logits_for).reshape(-1)]
            )
        contexts = []
        for i in rows:
            if mask is None:
                contexts.append(slots[: start + i + 1])
            else:
                contexts.append([slots[j] for j in range(start + T) if mask[i][j]])
        if len(contexts) == 1:
            out = [self.log_probs(contexts[0])]
        else:
            out = list(self._executor().map(self.log_probs, contexts))
        return torch.stack(out)[None], None  # (1, T', V)
