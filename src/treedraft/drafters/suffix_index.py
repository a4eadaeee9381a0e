"""A suffix index over token ids: longest match of a context and exact continuation counts.

Structure (chosen by measurement, see benchmarks/suffix_bench.py and benchmarks/results/suffix_bench.md):
the indexed sequences are concatenated into one int32 array with a separator (-1) after each, plus
one growable array of positions per token id. A lookup takes the positions of the context's last
token and narrows them, one token further back at a time, with vectorised comparisons: what is left
after ``m`` steps is exactly the set of occurrences of the context's last ``m`` tokens. The tokens
after those occurrences give the continuations and their counts, and following them grows a tree
of continuations, i.e. a walk down the (implicit) suffix tree of SuffixDecoding (Oliaro et al.,
"SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications", NeurIPS 2025).

Against a pure-Python suffix automaton (the other candidate) this holds ~12 bytes per token at 10^6
tokens instead of ~415, builds 10x faster (0.35 s against 3.4 s for 10^5 tokens), appends in O(1) per
token (the automaton's occurrence counts would need a pass over its suffix links after each batch), and
a lookup costs O(occurrences of the rarest of the last ``min_len`` tokens), vectorised. The drafter bounds
the work per step (at most 4096 seed occurrences, 256 per tree node, small sets grouped in plain Python):
at 10^6 tokens a whole draft (match + tree) takes median 0.19 ms, p90 0.40 ms (p90 1.3 ms uncapped), and
with ``min_len=2`` (the default drafter's suffix member) median 0.08 ms, p90 0.27 ms, on a loaded 2-core
machine (benchmarks/results/suffix_bench.md).
Matches never cross a separator, so one sequence's end never continues into the next one.

Per-step cost on repeated work (long matches, few occurrences; benchmarks/suffix_cost.py): the match is
extended a block of columns per numpy call (not one token per call), a handful of seed occurrences is
matched in plain Python, and a branch that is alone in the best-first heap is followed as one chain while
its occurrences agree. Each is the same result as the one-token-at-a-time walk (tests/test_suffix_fast.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

SEP = -1  # separator after every indexed sequence; never a token id
_BLOCK = 2048  # match(): candidates x columns compared per numpy gather
_COLS = np.arange(_BLOCK, dtype=np.int64)
_SMALL = 16  # match(): at most this many seed occurrences are matched in plain Python
_SCALAR_PUSH = 4096  # extend(): up to this many tokens, positions are appended one by one (no sort)
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class DraftPaths:
    """A tree of continuations: ``tokens[i]`` under ``parents[i]`` (-1 = under the root), ``probs[i]`` its path prob."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_len: int

    @property
    def score(self) -> float:
        """Expected number of accepted tokens under the empirical model (sum of path probabilities)."""
        return float(sum(self.probs))


class SuffixIndex:
    """Token sequences indexed for longest-suffix matching with exact occurrence counts."""

    def __init__(self) -> None:
        self._text = np.empty(1024, dtype=np.int32)
        self._n = 0
        self._pos: dict[int, np.ndarray] = {}  # token -> positions (capacity-padded)
        self._cnt: dict[int, int] = {}  # token -> number of valid entries in _pos[token]

    # ---- building -------------------------------------------------------
    def __len__(self) -> int:
        """Indexed positions, separators included."""
        return self._n

    @property
    def text(self) -> np.ndarray:
        """(n,) int32 view of the indexed tokens with SEP after each finished sequence."""
        return self._text[: self._n]

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        if need > len(self._text):
            cap = max(need, 2 * len(self._text))
            buf = np.empty(cap, dtype=np.int32)
            buf[: self._n] = self._text[: self._n]
            self._text = buf

    def extend(self, tokens: Sequence[int], end: bool = False) -> None:
        """Append tokens to the open sequence (``end=True`` closes it with a separator)."""
        if len(tokens) > _SCALAR_PUSH:
            self._extend_sorted(np.asarray(tokens, dtype=np.int64), end)
            return
        # per-step updates of a request's own index, a prompt, a finished request: plain Python
        vals = tokens.tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens]
        if vals and (min(vals) < 0 or max(vals) > _INT32_MAX):
            raise ValueError(f"token ids must be in [0, 2^31), got {min(vals)}..{max(vals)}")
        start = self._n
        self._reserve(len(vals) + (1 if end else 0))
        if vals:
            self._text[start : start + len(vals)] = vals
        if end:
            self._text[start + len(vals)] = SEP
        self._n = start + len(vals) + (1 if end else 0)
        pos, cnt = self._pos, self._cnt
        for i, t in enumerate(vals, start):
            buf, c = pos.get(t), cnt.get(t, 0)
            if buf is None or c == len(buf):
                buf = self._grow(t, c + 1)
            buf[c] = i
            cnt[t] = c + 1

    def _extend_sorted(self, arr: np.ndarray, end: bool) -> None:
        """:meth:`extend` for many tokens: positions grouped by token with one sort."""
        if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):
            raise ValueError(f"token ids must be in [0, 2^31), got {int(arr.min())}..{int(arr.max())}")
        k = int(arr.size) + (1 if end else 0)
        self._reserve(k)
        start = self._n
        self._text[start : start + arr.size] = arr
        if end:
            self._text[start + arr.size] = SEP
        self._n += k
        order = np.argsort(arr, kind="stable")  # positions grouped by token, ascending within a token
        toks = arr[order]
        cuts = (np.flatnonzero(np.diff(toks)) + 1).tolist()
        where = (order + start).astype(np.int32)
        for a, b in zip([0, *cuts], [*cuts, len(toks)]):
            self._push(int(toks[a]), where[a:b])

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Index one finished sequence."""
        self.extend(tokens, end=True)

    def _grow(self, tok: int, need: int) -> np.ndarray:
        """``tok``'s position buffer with room for ``need`` entries (doubling), its entries kept."""
        buf, c = self._pos.get(tok), self._cnt.get(tok, 0)
        if buf is not None and need <= len(buf):
            return buf
        nb = np.empty(max(4, need, 2 * (len(buf) if buf is not None else 0)), dtype=np.int32)
        if buf is not None:
            nb[:c] = buf[:c]
        self._pos[tok] = nb
        return nb

    def _push(self, tok: int, positions: np.ndarray) -> None:
        c = self._cnt.get(tok, 0)
        buf = self._grow(tok, c + len(positions))
        buf[c : c + len(positions)] = positions
        self._cnt[tok] = c + len(positions)

    @classmethod
    def from_sequences(cls, seqs: Iterable[Sequence[int]]) -> SuffixIndex:
        """Bulk build (one sort) from finished sequences."""
        parts: list[np.ndarray] = []
        for s in seqs:
            parts.append(np.asarray(s, dtype=np.int32))
            parts.append(np.array([SEP], dtype=np.int32))
        idx = cls()
        if not parts:
            return idx
        text = np.concatenate(parts)
        idx._text, idx._n = text, len(text)
        order = np.argsort(text, kind="stable").astype(np.int32)
        toks = text[order]
        first = int(np.searchsorted(toks, 0))  # skip separators
        order, toks = order[first:], toks[first:]
        cuts = np.flatnonzero(np.diff(toks)) + 1
        starts = np.concatenate([[0], cuts]).tolist()
        ends = np.concatenate([cuts, [len(toks)]]).tolist()
        for a, b in zip(starts, ends):
            if a < b:
                t = int(toks[a])
                idx._pos[t] = order[a:b]  # a view: copied on the first append to this token
                idx._cnt[t] = b - a
        return idx

    # ---- queries --------------------------------------------------------
    def positions(self, tok: int) -> np.ndarray:
        """(k,) int32 ascending positions where ``tok`` occurs."""
        buf = self._pos.get(int(tok))
        return buf[: self._cnt[int(tok)]] if buf is not None else np.empty(0, dtype=np.int32)

    def match(
        self, context: Sequence[int], max_len: int = 64, min_len: int = 1, max_occurrences: int | None = None
    ) -> tuple[int, np.ndarray]:
        """Longest suffix of ``context`` (``min_len`` .. ``max_len`` tokens) that occurs followed by a token.

        Returns (m, nxt): m = its length (0 if no suffix of ``min_len`` tokens occurs with a successor) and
        nxt = (k,) ascending positions right after each of its occurrences (where the continuation starts).

        Cost: the occurrences of the last ``min_len`` tokens are seeded from the *rarest* of those tokens,
        so ``min_len >= 2`` avoids scanning every occurrence of a frequent last token (" the", a newline).
        ``max_occurrences`` keeps only that many of the most recent seed occurrences (a bound on the work
        per lookup; None = all, exact).
        """
        if not context or max_len < 1 or min_len > min(max_len, len(context)):
            return 0, np.empty(0, dtype=np.int64)
        min_len = max(1, min_len)
        text, n = self.text, self._n
        limit = min(max_len, len(context))
        # seed: occurrences of the rarest of the last min_len tokens, shifted to "right after the suffix"
        w = min(min_len, len(context))
        j = min(range(w), key=lambda i: self._cnt.get(int(context[-1 - i]), 0))
        tok = int(context[-1 - j])
        buf, c = self._pos.get(tok), self._cnt.get(tok, 0)
        first = 0 if max_occurrences is None else max(0, c - max_occurrences)  # keep the most recent ones
        if buf is None or c - first <= _SMALL:
            return self._match_few([] if buf is None else buf[first:c].tolist(), j + 1, context, w, limit)
        nxt = buf[first:c].astype(np.int64) + (j + 1)
        nxt = nxt[(nxt - w >= 0) & (nxt < n)]
        for i in range(w):  # all of the last w tokens must match (no separator inside: SEP is never a token)
            if i != j and nxt.size:
                nxt = nxt[text[nxt - 1 - i] == context[-1 - i]]
        if nxt.size:
            nxt = nxt[text[nxt] != SEP]
        if nxt.size == 0:
            return 0, nxt
        m = w
        if m >= limit:
            return m, nxt
        # extend backwards a block of columns at a time: one gather compares every candidate's next ``width``
        # tokens before its occurrence with the context's, and the candidates that agree the furthest are
        # kept (the same set as narrowing one token at a time while any candidate is left, in a few numpy
        # calls instead of one round per matched token: long matches are the common case on repeated work)
        want = np.asarray(context[len(context) - limit :], dtype=np.int64)[::-1]  # (limit,) context, newest first
        while m < limit:
            width = min(limit - m, max(1, _BLOCK // nxt.size))
            back = nxt[:, None] - (1 + m) - _COLS[:width]  # (k, width) positions m+1.. places before each
            ok = (back >= 0) & (text[np.maximum(back, 0)] == want[m : m + width])
            full = ok.all(axis=1)
            if full.any():  # some agree on the whole block: only those can be the longest
                nxt = nxt[full]
                m += width
                continue
            run = ok.argmin(axis=1)  # (k,) columns each candidate agrees on (the first mismatch)
            best = int(run.max())
            if best:
                nxt = nxt[run == best]
                m += best
            break
        return m, nxt

    def _match_few(
        self, seeds: list[int], shift: int, context: Sequence[int], w: int, limit: int
    ) -> tuple[int, np.ndarray]:
        """:meth:`match` for a few seed occurrences, in plain Python (numpy's per-call cost dominates there).

        Each candidate's match length is the common suffix of the context and the text before it (at most
        ``limit``); the longest ones win, as narrowing one token at a time would leave them.
        """
        text, n = self.text, self._n
        tail = [int(t) for t in context[len(context) - limit :]]  # (limit,) the context's last tokens
        best, kept = 0, []
        for s in seeds:
            q = s + shift  # right after the suffix
            if q - w < 0 or q >= n or text[q] == SEP:
                continue
            before = text[max(0, q - limit) : q].tolist()
            k = len(before)
            if before == tail[limit - k :]:
                length = k
            else:
                length = 0
                while before[k - 1 - length] == tail[limit - 1 - length]:
                    length += 1
            if length < w or length < best:
                continue
            if length > best:
                best, kept = length, []
            kept.append(q)
        return best, np.array(kept, dtype=np.int64)

    def follow(self, new: Sequence[int], m: int, nxt: np.ndarray, max_len: int = 64) -> tuple[int, np.ndarray] | None:
        """The next step's :meth:`match` from this step's ``(m, nxt)``, after the context grew by the tokens ``new``.

        The occurrences that go on with ``new`` match ``m + len(new)`` tokens, and no occurrence can match more
        (it would have matched more than ``m`` before), so they are the new longest match: what :meth:`match`
        returns, when ``(m, nxt)`` was exact (every occurrence seen) and the index only grew at its end since.
        None when none goes on (a fresh :meth:`match` is needed). Cost: O(len(nxt) x len(new)), no seeding.

        Also None when ``m + len(new)`` exceeds ``max_len``: a match capped at ``max_len`` tokens counts every
        occurrence of the context's last ``max_len`` tokens, and the followed ones (those that also match the
        tokens before) are only a subset of them, shrinking step by step (on MT-Bench second turns down to
        one occurrence where a fresh match had seven: other counts, shorter priced chains, more steps).
        """
        k = len(new)
        if k == 0 or m < 1 or len(nxt) == 0 or m + k > max_len:
            return None
        text, n = self.text, self._n
        if len(nxt) <= _SMALL:
            want = [int(t) for t in new]
            kept = [q + k for q in nxt.tolist() if q + k < n and text[q : q + k].tolist() == want]
            kept = [q for q in kept if text[q] != SEP]
            if not kept:
                return None
            return m + k, np.array(kept, dtype=np.int64)
        ok = nxt + k < n
        cand = nxt[ok]
        for j, t in enumerate(new):
            cand = cand[text[cand + j] == int(t)]
        cand = cand + k
        cand = cand[text[cand] != SEP]
        return (m + k, cand) if cand.size else None

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """{next token: count} over every occurrence of ``pattern`` (empty if it never occurs)."""
        if not pattern:
            raise ValueError("pattern must have at least one token")
        m, nxt = self.match(pattern, max_len=len(pattern))
        if m < len(pattern):
            return {}
        toks, counts = np.unique(self.text[nxt], return_counts=True)
        return {int(t): int(c) for t, c in zip(toks, counts)}

    def expand(
        self,
        nxt: np.ndarray,
        match_len: int,
        max_nodes: int,
        max_depth: int,
        min_prob: float = 0.0,
        max_occurrences: int = 1024,
        accept: Sequence[float] | None = None,
        take: Callable[[float], bool] | None = None,
    ) -> DraftPaths:
        """Best-first tree of the most probable continuations after the occurrences ``nxt``.

        A node's probability is the product along its path of count(child) / count(parent): the
        empirical probability of that continuation (SuffixDecoding's score). At most ``max_nodes`` nodes
        (root excluded), ``max_depth`` deep, none below ``min_prob``. Only the most recent
        ``max_occurrences`` occurrences are counted (all of them unless a match is very frequent).

        Priced expansion: with ``accept`` (a node at depth d also multiplies its value by ``accept[d - 1]``,
        all in [0, 1]) nodes come out best-first by that *value* instead, and ``probs`` holds the values;
        ``take(value)`` (called before each node is added) ends the expansion when it returns False.
        """
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if max_nodes < 1 or max_depth < 1 or len(nxt) == 0:
            return DraftPaths(tokens, parents, probs, match_len)
        deepest = min(max_depth, max_nodes + 1)  # a child is valued when pushed, even one the budget leaves out
        if accept is not None and len(accept) < deepest:
            raise ValueError(f"accept needs a factor per depth up to {deepest}, got {len(accept)}")
        text, n = self.text, self._n
        # (-value, tiebreak, parent, depth, token, positions after it (a list when few, else an array), prob);
        # value = prob without ``accept``
        heap: list[tuple[float, int, int, int, int, list[int] | np.ndarray, float]] = []
        tick = 0

        def push(prob: float, parent: int, depth: int, t: int, pos: list[int] | np.ndarray, value: float) -> None:
            nonlocal tick
            tick += 1
            v = prob if accept is None else value * accept[depth - 1]  # value: the parent's x the count ratio
            heapq.heappush(heap, (-v, tick, parent, depth, t, pos, prob))

        def push_children(
            pos: list[int] | np.ndarray, parent: int, depth: int, prob: float, value: float = 1.0
        ) -> None:
            nonlocal tick
            if depth >= max_depth:
                return
            pos = pos[-max_occurrences:]
            if len(pos) <= 32:  # a long match has few occurrences: plain Python beats numpy's call overhead
                live_pos = [q for q in (pos.tolist() if isinstance(pos, np.ndarray) else pos) if q < n]
                total = len(live_pos)  # occurrences that end here (SEP) keep their share: they continue nowhere
                groups: dict[int, list[int]] = {}
                for q, t in zip(live_pos, text[live_pos].tolist() if total > 8 else [int(text[q]) for q in live_pos]):
                    if t != SEP:
                        groups.setdefault(t, []).append(q + 1)
                for t in sorted(groups):  # the same order as the numpy path (by token id)
                    p = prob * len(groups[t]) / total
                    if p >= min_prob:
                        push(p, parent, depth + 1, t, groups[t], value * len(groups[t]) / total)
                return
            assert isinstance(pos, np.ndarray)
            pos = pos[pos < n]
            if pos.size == 0:
                return
            nt = text[pos]
            total = pos.size  # occurrences that end here (SEP) keep their share: they continue nowhere
            live = nt != SEP
            pos, nt = pos[live], nt[live]
            if pos.size == 0:
                return
            order = np.argsort(nt, kind="stable")  # groups by token, positions ascending within a group
            toks, first, counts = np.unique(nt[order], return_index=True, return_counts=True)
            spos = pos[order]
            for t, a, c in zip(toks.tolist(), first.tolist(), counts.tolist()):
                p = prob * c / total
                if p >= min_prob:
                    push(p, parent, depth + 1, t, spos[a : a + c] + 1, value * c / total)

        push_children(nxt, -1, 0, 1.0)
        while heap and len(tokens) < max_nodes:
            if take is not None and not take(-heap[0][0]):
                break
            negv, _, parent, depth, tok, pos, prob = heapq.heappop(heap)
            me = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            probs.append(-negv)
            if heap or depth >= max_depth:
                push_children(pos, me, depth, prob, -negv)
                continue
            # the only branch left: while all its occurrences go on with the same token, each step would
            # push exactly one child and pop it next, so append that chain directly (same nodes, same order)
            value = -negv
            live = pos[-max_occurrences:]
            live = [q for q in live if q < n] if isinstance(live, list) else live[live < n]
            k = len(live)
            chain = self._common_run(live, min(max_depth - depth, max_nodes - len(tokens)))
            if not chain:
                push_children(live, me, depth, prob, value)
                continue
            for t in chain:
                p = prob * k / k  # as push_children computes it (not always exactly ``prob``)
                v = p if accept is None else value * accept[depth] * k / k
                if p < min_prob or (take is not None and not take(v)):
                    break
                prob, value, me, depth = p, v, me + 1, depth + 1
                tokens.append(t)
                parents.append(me - 1)
                probs.append(v)
            else:
                run = len(chain)
                shifted = [q + run for q in live] if isinstance(live, list) else live + run
                push_children(shifted, me, depth, prob, value)
        return DraftPaths(tokens, parents, probs, match_len)

    def _common_run(self, pos: list[int] | np.ndarray, limit: int) -> list[int]:
        """The tokens at ``pos + j``, j = 0, 1, .. < ``limit``, while they are the same at every position (no SEP,
        all inside the text)."""
        if len(pos) == 0 or limit < 1:
            return []
        text, n = self.text, self._n
        if len(pos) <= 32:
            segs = [text[q : min(n, q + limit)].tolist() for q in pos]
            if len(segs) == 1:
                run = segs[0]
                return run[: run.index(SEP)] if SEP in run else run
            out: list[int] = []
            k = len(segs)
            for col in zip(*segs):  # stops at the shortest: a position reaching the end of the text
                t = col[0]
                if t == SEP or col.count(t) != k:
                    break
                out.append(t)
            return out
        assert isinstance(pos, np.ndarray)
        run = 0
        while run < limit:
            width = min(limit - run, max(4, _BLOCK // pos.size))
            at = pos[:, None] + (run + _COLS[:width])  # (k, width)
            vals = text[np.minimum(at, n - 1)]
            ok = ((at < n) & (vals == vals[0]) & (vals != SEP)).all(axis=0)  # (width,) columns where all agree
            if not ok.all():
                run += int(ok.argmin())
                break
            run += width
        q = int(pos[0])
        return text[q : q + run].tolist()


def brute_force_continuations(seqs: Sequence[Sequence[int]], pattern: Sequence[int]) -> dict[int, int]:
    """{next token: count} by scanning every sequence (the reference the index is tested against)."""
    out: dict[int, int] = {}
    m = len(pattern)
    for s in seqs:
        for i in range(len(s) - m):
            if list(s[i : i + m]) == list(pattern):
                out[s[i + m]] = out.get(s[i + m], 0) + 1
    return out
