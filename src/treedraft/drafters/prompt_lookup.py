"""Prompt lookup / n-gram drafter (Saxena 2023, "prompt lookup decoding").

Find earlier occurrences of the context's last n tokens (longest n first) in
prompt + output and propose the tokens that followed them. Several distinct
matches become branches of one tree instead of a single chain.

Adaptive length (default): a branch is as long as its match already runs backwards
(the number of tokens before the cursor that equal the tokens before the earlier
occurrence), capped at ``max_tokens``. A text that has been copying an earlier
passage for 10 tokens tends to go on copying it; a one-token match rarely pays for
more than one draft. In the hybrid drafter on the 80 MT-Bench first turns x 256 tokens
(benchmarks/results/bench-mtbench80 against -before): mean accepted length 2.06 -> 2.22 over a
fixed 3 tokens, as an offline replay predicted (2.24); tokens/s unchanged within noise on this
CPU (1.45x -> 1.43x plain), where each extra verified token costs ~0.15x a forward. The longer
branches pay where verification is cheaper per token (a GPU): raise ``max_tokens`` there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..interfaces import DraftContext
from ..tree import TokenTree

RUN_CAP = 64  # with a prediction: how far back a match's run is measured (beyond it, runs count as equal)


def _runs(arr: np.ndarray, starts: list[int], n: int, cap: int) -> np.ndarray:
    """match_length for every occurrence in ``starts`` at once, each capped at ``cap`` (>= n): vectorised, so a
    prediction full of repeats costs O(occurrences x cap) array work per step, not a Python walk per occurrence."""
    L = len(arr)
    k = np.arange(max(cap - n, 0))
    a = np.asarray(starts, dtype=np.int64)[:, None] - 1 - k[None, :]  # before each occurrence, going back
    b = L - 1 - n - k  # before the cursor's n tokens, going back (>= 0 where a is: s <= L - n - 1)
    same = (a >= 0) & (arr[np.maximum(a, 0)] == arr[np.maximum(b, 0)][None, :])
    extra = np.where(same.all(1), len(k), same.argmin(1)) if len(k) else np.zeros(len(starts), dtype=np.int64)
    return n + extra


@dataclass
class PromptLookupDrafter:
    max_ngram: int = 3
    min_ngram: int = 1
    # Sized for a 2-core CPU, where a 4-token forward costs ~1.5x a 1-token one and 9 tokens ~2x
    # (bench: 8 tokens x 4 branches ran at 0.64x plain decoding). Raise both where verify is cheap (GPU).
    num_tokens: int = 3  # continuation length per branch when not adaptive
    max_branches: int = 1
    adaptive: bool = True  # length = how far the match runs backwards, 1 .. max_tokens
    max_tokens: int = 12
    name: str = "prompt-lookup"

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.num_tokens < 1 or self.max_branches < 1 or self.max_tokens < 1:
            raise ValueError("num_tokens, max_tokens and max_branches must be >= 1")

    @staticmethod
    def match_length(tokens: list[int], s: int, n: int) -> int:
        """How many tokens before the cursor equal those before the occurrence at ``s`` (n matched)."""
        L, m = len(tokens), n
        while s - 1 - (m - n) >= 0 and tokens[s - 1 - (m - n)] == tokens[L - 1 - m]:
            m += 1
        return m

    def candidates(self, tokens: list[int], depth: int, reference: Sequence[int] = ()) -> list[list[int]]:
        """Continuations (after the root) of the most recent matches, longest n-gram first.

        ``depth`` caps every continuation; adaptive branches are also cut to their match length.
        ``reference`` (a predicted output, :attr:`DraftContext.reference`) is searched as well, as text before the
        prompt that no match runs across; then, per n-gram length, the occurrences whose match runs back furthest
        come first, wherever they are: a prediction's aligned occurrence beats a stray recent one.
        """
        seqs: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        if reference:
            tokens = [*reference, -1, *tokens]  # -1: no token id, so no match or continuation crosses it
        L = len(tokens)
        arr = np.asarray(tokens, dtype=np.int64)  # (L,): the occurrences are found vectorised, not by a Python scan
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            # starts s <= L - n - 1 whose n tokens equal the last n (at least one token follows them)
            hit = arr[: L - n] == arr[L - n]
            for j in range(1, n):
                hit &= arr[j : L - n + j] == arr[L - n + j]
            # most recent first: recent matches are better predictors
            starts = np.flatnonzero(hit)[::-1].tolist()
            runs = None
            if reference and starts:
                # longest run first (runs of RUN_CAP and more alike); among equals the context's own occurrences
                # most recent first, then the prediction's earliest first: in a repetitive prediction the earliest
                # occurrence with the longest run is the one aligned with the output so far
                R = len(reference)
                runs = dict(zip(starts, _runs(arr, starts, n, RUN_CAP).tolist(), strict=True))
                starts.sort(key=lambda s: (-runs[s], s < R, s if s < R else -s))
            for s in starts:
                run = runs[s] if runs is not None else self.match_length(tokens, s, n) if self.adaptive else 0
                length = min(depth, run) if self.adaptive else depth
                cont = tokens[s + n : s + n + length]
                if reference and -1 in cont:
                    cont = cont[: cont.index(-1)]
                key = tuple(cont)
                if cont and key not in seen and not any(k[: len(key)] == key for k in seen):
                    seen.add(key)
                    seqs.append(cont)
                    if len(seqs) >= self.max_branches:
                        return seqs
        return seqs

    def propose(self, ctx: DraftContext) -> TokenTree:
        depth = min(self.max_tokens if self.adaptive else self.num_tokens, ctx.max_depth)
        seqs = self.candidates(ctx.tokens, depth, ctx.reference)
        return TokenTree.from_sequences(ctx.root, seqs, max_nodes=ctx.max_nodes)
