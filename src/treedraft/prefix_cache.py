"""Prompt prefix cache: a joining request reuses the keys/values an earlier request computed for its prompt.

A server sees the same prompt prefixes again and again (a system prompt, a conversation's earlier turns, a
client retrying, a load test's levels sending the same prompts); vLLM's automatic prefix caching and SGLang's
RadixAttention skip their prefill. Here an entry is one finished prompt prefill: the ``(2*layers, 1, n_kv,
n, hd)`` keys/values of its ``n`` positions, the hidden states of those positions (what a drafter is handed
for prompt positions) and the last position's logits row and hidden state (what the first token is drawn from).

Exactness: a request's prefill runs in chunks that start at multiples of ``chunk_rows``
(:class:`treedraft.scheduler.Scheduler`), and a position's keys/values depend only on the tokens up to it
and on the chunk it was computed in. So a request reuses either a whole identical prompt (same chunks: its
cache, hidden states and first-token logits are bitwise those it would compute) or the longest prefix it
shares with an entry that ends on a chunk boundary (it then prefills the rest from that boundary, as alone).
Through the native decoder a row's bits do not depend on the chunk it sits in (row-invariant kernels and a
fixed-order attention reduction, kernels/fused.h), so there ``chunk_rows=1``: any shared prefix is reused,
e.g. the chat template's system prompt that every request starts with (24 of SmolLM2's 50-140 token MT-Bench
prompts). Prefixes are found by a rolling hash of the tokens and confirmed token by token.
The first token is still drawn by the request's own rule, sampling parameters and generator.

Entries are scoped (the server's tenant: API key or ``user``; "" = anonymous), like the suffix drafter's
store: a tenant never reuses (or learns from the timing of) another tenant's prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

_Key = tuple[str, tuple[int, ...]]  # (scope, tokens)
_MOD = (1 << 61) - 1  # rolling hash of a prefix: h(t_1..t_m) = sum t_i B^(m-i) mod 2^61 - 1
_BASE = 1_000_003


def _prefix_hashes(toks: Sequence[int]) -> list[int]:
    """[h(toks[:m]) for m = 0 .. len(toks)] (one pass)."""
    out, h = [0], 0
    for t in toks:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


@dataclass(frozen=True)
class PrefixEntry:
    """One cached prompt prefill (tensors are private copies, never written)."""

    tokens: tuple[int, ...]  # (n,) the prompt
    kv: Tensor  # (2 * layers, 1, n_kv, n, head_dim) keys then values, as the request's KVCache holds them
    hidden: Tensor | None  # (n, H) hidden states of the prompt positions (None: the forward gave none)
    logits: Tensor  # (V,) the last position's logits (the first token's distribution)

    @property
    def nbytes(self) -> int:
        """Bytes held by this entry's tensors."""
        h = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return self.kv.numel() * self.kv.element_size() + h + self.logits.numel() * self.logits.element_size()


@dataclass(frozen=True)
class PrefixHit:
    """What a joining request may reuse: the entry and how many of its positions (``n == len(prompt)``: all)."""

    entry: PrefixEntry
    n: int


class PrefixCache:
    """Least-recently-used prompt prefills, up to ``max_bytes``, looked up by whole prompt or chunk-aligned prefix.

    chunk_rows: the scheduler's prefill chunk (a partial reuse ends on a multiple of it; 1: anywhere, for a
        row-invariant prefill; None: whole prompts are prefilled in one chunk, so only identical prompts are reused).
    """

    def __init__(self, max_bytes: int, chunk_rows: int | None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes} (give no prefix cache to disable it)")
        if chunk_rows is not None and chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.max_bytes, self.chunk_rows = max_bytes, chunk_rows
        self._entries: OrderedDict[_Key, PrefixEntry] = OrderedDict()  # (scope, prompt) -> entry, oldest first
        self._prefixes: dict[tuple[str, int, int], _Key] = {}  # (scope, m, hash of m tokens) -> entry key
        self.nbytes = 0
        self.hits = self.partial_hits = self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _prefix_keys(self, scope: str, toks: Sequence[int], n: int) -> list[tuple[int, tuple[str, int, int]]]:
        """(m, key of the m-token prefix of ``toks`` in ``scope``) for the chunk-aligned m shorter than ``n``,
        longest first."""
        c = self.chunk_rows
        if c is None:
            return []
        hashes = _prefix_hashes(toks)
        return [(m, (scope, m, hashes[m])) for m in range(((n - 1) // c) * c, 0, -c)]

    def lookup(self, prompt: Sequence[int], need_hidden: bool = False, scope: str = "") -> PrefixHit | None:
        """The longest reusable prefix of ``prompt`` in ``scope`` (None: nothing); ``need_hidden``: only entries
        with hidden states."""
        toks = tuple(prompt)
        key = (scope, toks)
        e = self._entries.get(key)
        if e is not None and (e.hidden is not None or not need_hidden):
            self._entries.move_to_end(key)
            self.hits += 1
            self.reused_tokens += len(toks)
            return PrefixHit(e, len(toks))
        for m, k in self._prefix_keys(scope, toks, len(toks)):
            owner = self._prefixes.get(k)
            e = None if owner is None else self._entries.get(owner)
            if e is not None and e.tokens[:m] == toks[:m] and (e.hidden is not None or not need_hidden):
                self._entries.move_to_end(owner)
                self.partial_hits += 1
                self.reused_tokens += m
                return PrefixHit(e, m)
        self.misses += 1
        return None

    def store(self, prompt: Sequence[int], kv: Tensor, hidden: Tensor | None, logits: Tensor, scope: str = "") -> None:
        """Keep a finished prompt prefill in ``scope`` (copies the tensors); the oldest entries go over ``max_bytes``."""
        toks = tuple(int(t) for t in prompt)
        key, n = (scope, toks), len(toks)
        if kv.shape[3] != n or (hidden is not None and hidden.shape[0] != n) or logits.dim() != 1:
            raise ValueError(
                f"prefix entry of {n} tokens needs kv (.., {n}, hd), hidden ({n}, H) and logits (V,), got "
                f"{tuple(kv.shape)}, {None if hidden is None else tuple(hidden.shape)}, {tuple(logits.shape)}"
            )
        h = None if hidden is None else hidden.detach().clone()
        e = PrefixEntry(toks, kv.detach().clone(), h, logits.detach().clone())
        if e.nbytes > self.max_bytes:
            return  # larger than the whole cache: not kept
        self._drop(key)
        self._entries[key] = e
        self.nbytes += e.nbytes
        for _m, k in self._prefix_keys(scope, toks, n + 1):  # prefixes ending on a chunk boundary, the whole prompt too
            self._prefixes[k] = key
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: _Key) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        self.nbytes -= e.nbytes
        scope, toks = key
        # (a prefix another entry shares is forgotten too: a lost hit)
        for _m, k in self._prefix_keys(scope, toks, len(toks) + 1):
            if self._prefixes.get(k) == key:
                del self._prefixes[k]


__all__ = ["PrefixCache", "PrefixEntry", "PrefixHit"]
