"""JSON Schema ``pattern`` and ``format`` for strings: an ECMA-262 regular expression (the subset without
backreferences, lookaround or anchors inside the expression) as a DFA over Unicode code points, which the JSON
automaton (:mod:`treedraft.grammar`) runs over a string's characters as their bytes arrive.

A ``pattern`` matches anywhere in the string (JSON Schema's rule) unless anchored: each top-level alternative may
start with ``^`` and end with ``$``. ``format`` ``date``, ``time``, ``date-time``, ``duration``, ``uuid``, ``email``,
``hostname``, ``ipv4`` and ``ipv6`` (the formats OpenAI's structured outputs list) are patterns of a subset of their
valid strings (no February 29th, no leap second, hostnames of up to 4 labels of up to 62 characters, IPv6 without an
embedded IPv4: a generated string always validates). DFA states from which no match can be completed are dropped,
so a patterned string never dead-ends.
"""

from __future__ import annotations

import bisect
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext

MAX_CP = 0x10FFFF
MAX_NFA = 20000  # states of the expanded expression (counted repetitions copy it)
MAX_DFA = 4000
MAX_PRODUCT = 20000  # states of two DFAs combined (a format with a length bound: email x maxLength 64 ~ 9,600)

Ranges = tuple  # sorted, disjoint (lo, hi) code point ranges


def _norm(rs) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(rs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def _neg(rs: Ranges) -> Ranges:
    out, at = [], 0
    for lo, hi in rs:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CP:
        out.append((at, MAX_CP))
    return tuple(out)


_DIGIT = ((0x30, 0x39),)
_WORD = _norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_SPACE = _norm([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])  # fmt: skip
_DOT = _neg(_norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))  # ECMA's line terminators
_ANY = ((0, MAX_CP),)
_CLASS_ESC = {"d": _DIGIT, "D": _neg(_DIGIT), "w": _WORD, "W": _neg(_WORD), "s": _SPACE, "S": _neg(_SPACE)}
_CTRL_ESC = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}


class _Parser:
    """Recursive descent over the pattern; nodes: ("set", ranges), ("cat", [...]), ("alt", [...]),
    ("rep", node, min, max or None)."""

    def __init__(self, src: str) -> None:
        self.s, self.i = src, 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"pattern {self.s!r}: {what} (at {self.i})")

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def top(self) -> list[tuple[bool, object, bool]]:
        """The top-level alternatives, each with its anchors: (starts with ^, node, ends with $)."""
        alts = []
        while True:
            bol = self.peek() == "^"
            self.i += bol
            node = self.cat(top=True)
            eol = self.peek() == "$"
            self.i += eol
            alts.append((bol, node, eol))
            if self.peek() == "|":
                self.i += 1
                continue
            if self.i < len(self.s):
                raise self.fail(f"unexpected {self.peek()!r}" if self.peek() != "$" else "'$' before the end")
            return alts

    def alt(self) -> object:
        parts = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.cat())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def cat(self, top: bool = False) -> object:
        items = []
        while self.i < len(self.s) and self.peek() not in "|)":
            if self.peek() == "$" and top:
                break
            items.append(self.quantified())
        return ("cat", items)

    def quantified(self) -> object:
        atom = self.atom()
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (counted := self._counted()) is not None:
                lo, hi, self.i = counted
            else:
                return atom
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
            atom = ("rep", atom, lo, hi)

    def _counted(self) -> tuple[int, int | None, int] | None:
        """A counted repetition ``{n}``, ``{n,}``, ``{n,m}`` here: (n, m or None, where it ends); None where the
        brace is a literal character."""
        j = self.s.find("}", self.i)
        if j < 0:
            return None
        body = self.s[self.i + 1 : j]
        lo, comma, hi = body.partition(",")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        a, b = int(lo), (int(hi) if hi else None) if comma else int(lo)
        if b is not None and b < a:
            raise self.fail(f"{{{body}}}: the maximum is below the minimum")
        return a, b, j + 1

    def atom(self) -> object:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("lookaround and named groups are not supported")
            node = self.alt()
            if self.peek() != ")":
                raise self.fail("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return ("set", self.klass())
        if c == ".":
            self.i += 1
            return ("set", _DOT)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in ("^", "$"):
            raise self.fail(f"'{c}' is supported only at the start / end of a top-level alternative")
        if c in ("*", "+", "?", ")"):
            raise self.fail(f"nothing to repeat or an unmatched {c!r}")
        if c == "{" and self._counted() is not None:
            raise self.fail("nothing to repeat")
        self.i += 1
        return ("set", ((ord(c), ord(c)),))

    def escape(self, in_class: bool) -> Ranges:
        self.i += 1  # the backslash
        c = self.peek()
        if not c:
            raise self.fail("a trailing backslash")
        self.i += 1
        if c in _CLASS_ESC:
            return _CLASS_ESC[c]
        if c in _CTRL_ESC:
            return ((_CTRL_ESC[c],) * 2,)
        if c in ("u", "x"):
            n = 4 if c == "u" else 2
            h = self.s[self.i : self.i + n]
            if len(h) != n or any(x not in "0123456789abcdefABCDEF" for x in h):
                raise self.fail(f"\\{c} needs {n} hex digits")
            self.i += n
            return ((int(h, 16),) * 2,)
        if c == "b" and in_class:
            return ((0x08, 0x08),)
        if c.isalnum():
            raise self.fail(f"\\{c} is not supported (backreferences, word boundaries, ...)")
        return ((ord(c), ord(c)),)

    def klass(self) -> Ranges:
        self.i += 1
        neg = self.peek() == "^"
        self.i += neg
        rs: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.fail("missing ']'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_atom()
            if self.peek() == "-" and self.s[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise self.fail("a range between classes")
                if hi[0][0] < lo[0][0]:
                    raise self.fail("a range out of order")
                rs.append((lo[0][0], hi[0][0]))
            else:
                rs.extend(lo)
        out = _norm(rs)
        return _neg(out) if neg else out

    def class_atom(self) -> Ranges:
        if self.peek() == "\\":
            return self.escape(in_class=True)
        c = self.peek()
        self.i += 1
        return ((ord(c), ord(c)),)


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[Ranges, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA:
            raise ValueError(f"pattern too large (over {MAX_NFA} states once its counted repetitions are expanded)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node, start: int) -> int:
        """Adds ``node`` from ``start``; returns its end state."""
        kind = node[0]
        if kind == "set":
            end = self.state()
            if node[1]:
                self.edges[start].append((node[1], end))
            return end
        if kind == "cat":
            for part in node[1]:
                start = self.build(part, start)
            return start
        if kind == "alt":
            end = self.state()
            for part in node[1]:
                s = self.state()
                self.eps[start].append(s)
                self.eps[self.build(part, s)].append(end)
            return end
        _, inner, lo, hi = node
        for _ in range(lo):
            start = self.build(inner, start)
        if hi is None:  # a loop
            loop = self.state()
            self.eps[start].append(loop)
            self.eps[self.build(inner, loop)].append(loop)
            return loop
        end = self.state()
        self.eps[start].append(end)
        for _ in range(hi - lo):
            start = self.build(inner, start)
            self.eps[start].append(end)
        return end


class Pattern:
    """A DFA over code points: ``next(state, cp)`` (-1: no match can follow), ``accepts(state)``; state 0 is the
    start. Only states from which a match can still be completed are kept."""

    def __init__(self, source: str, label: str | None = None, full: bool = False) -> None:
        """``full``: the whole text must match, as with ``re.fullmatch`` (every top-level alternative anchored at
        both ends, so ``^`` / ``$`` there change nothing); else JSON Schema's search semantics."""
        self.source = label or source
        alts = _Parser(source).top()
        nfa = _NFA()
        start, accept = nfa.state(), nfa.state()
        for bol, node, eol in alts:
            bol, eol = bol or full, eol or full
            s = nfa.state()
            nfa.eps[start].append(s)
            if not bol:
                s = nfa.build(("rep", ("set", _ANY), 0, None), s)
            s = nfa.build(node, s)
            if not eol:
                s = nfa.build(("rep", ("set", _ANY), 0, None), s)
            nfa.eps[s].append(accept)
        self._determinize(nfa, start, accept)

    def _determinize(self, nfa: _NFA, start: int, accept: int) -> None:
        def closure(states) -> frozenset:
            seen, todo = set(states), list(states)
            while todo:
                for t in nfa.eps[todo.pop()]:
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            return frozenset(seen)

        cuts = {0, MAX_CP + 1}
        for edges in nfa.edges:
            for rs, _ in edges:
                for lo, hi in rs:
                    cuts.update((lo, hi + 1))
        self._cuts = sorted(cuts)[:-1]  # interval starts
        first = closure([start])
        index = {first: 0}
        sets = [first]
        table: list[list[int]] = []
        while len(table) < len(sets):
            cur = sets[len(table)]
            row = []
            for lo in self._cuts:
                nxt = {t for s in cur for rs, t in nfa.edges[s] if _has(rs, lo)}
                if not nxt:
                    row.append(-1)
                    continue
                key = closure(nxt)
                if key not in index:
                    if len(sets) >= MAX_DFA:
                        raise ValueError(f"pattern too complex (over {MAX_DFA} automaton states)")
                    index[key] = len(sets)
                    sets.append(key)
                row.append(index[key])
            table.append(row)
        self._finish(table, [accept in s for s in sets])

    def _finish(self, table: list[list[int]], acc: list[bool]) -> None:
        """Keeps the transitions into states from which a match can still be completed."""
        live = set(i for i, a in enumerate(acc) if a)
        changed = True
        while changed:
            changed = False
            for i, row in enumerate(table):
                if i not in live and any(t in live for t in row):
                    live.add(i)
                    changed = True
        if 0 not in live:
            raise ValueError(f"pattern {self.source!r} matches no string")
        self._next = [[t if t in live else -1 for t in row] for row in table]
        self._accept = acc

    @classmethod
    def from_dfa(cls, label: str, cuts: list[int], start: object, step, accepts) -> Pattern:
        """A DFA given by its transitions: ``cuts`` the first code point of each interval of the alphabet (from 0),
        ``step(state, cut)`` the state after a code point of the interval starting at ``cut`` (None: refused),
        ``accepts(state)``; states are any hashable values, numbered here from ``start``."""
        out = cls.__new__(cls)
        out.source, out._cuts = label, list(cuts)
        index, states, table = {start: 0}, [start], []
        while len(table) < len(states):
            row = []
            for lo in out._cuts:
                nxt = step(states[len(table)], lo)
                if nxt is not None and nxt not in index:
                    if len(states) >= MAX_PRODUCT:
                        raise ValueError(f"{label}: too complex (over {MAX_PRODUCT} automaton states)")
                    index[nxt] = len(states)
                    states.append(nxt)
                row.append(-1 if nxt is None else index[nxt])
            table.append(row)
        out._finish(table, [bool(accepts(x)) for x in states])
        return out

    def __and__(self, other: Pattern) -> Pattern:
        """The DFA of the strings both match (the product automaton)."""
        out = Pattern.__new__(Pattern)
        out.source = f"{self.source} and {other.source}"
        out._cuts = sorted(set(self._cuts) | set(other._cuts))
        index = {(0, 0): 0}
        pairs = [(0, 0)]
        table: list[list[int]] = []
        while len(table) < len(pairs):
            a, b = pairs[len(table)]
            row = []
            for lo in out._cuts:
                key = (self.next(a, lo), other.next(b, lo))
                if key[0] < 0 or key[1] < 0:
                    row.append(-1)
                    continue
                if key not in index:
                    if len(pairs) >= MAX_PRODUCT:
                        raise ValueError(f"{out.source}: too complex together (over {MAX_PRODUCT} automaton "
                                         "states); drop or loosen one of them")  # fmt: skip
                    index[key] = len(pairs)
                    pairs.append(key)
                row.append(index[key])
            table.append(row)
        out._finish(table, [self.accepts(a) and other.accepts(b) for a, b in pairs])
        return out

    def next(self, state: int, cp: int) -> int:
        return self._next[state][bisect.bisect_right(self._cuts, cp) - 1]

    def classes(self) -> tuple[list[int], list[int], list[list[int]]]:
        """The code points in classes that every state treats alike: (each class's first code point, sorted; the
        class of the code points from each of them on, in the same order; per state, the next state by class).
        Intervals of the DFA's alphabet that no state tells apart share a class (``[A-Za-z ]``: one)."""
        sig: dict[tuple[int, ...], int] = {}
        of = [sig.setdefault(tuple(row[j] for row in self._next), len(sig)) for j in range(len(self._cuts))]
        rep = [0] * len(sig)
        for j in reversed(range(len(of))):
            rep[of[j]] = j
        return self._cuts, of, [[row[rep[k]] for k in range(len(sig))] for row in self._next]

    def accepts(self, state: int) -> bool:
        return self._accept[state]

    def any_in(self, state: int, lo: int, hi: int) -> bool:
        """Whether some code point in lo..hi can follow ``state`` (towards a match)."""
        cuts = self._cuts
        row = self._next[state]
        return any(t >= 0 for t in row[bisect.bisect_right(cuts, lo) - 1 : bisect.bisect_right(cuts, hi)])


class Length:
    """``minLength`` / ``maxLength`` (characters, i.e. code points) as the DFA :class:`Pattern` would be for
    ``^[\\s\\S]{lo,hi}$``, without building it: state = the characters so far (up to ``hi``; -1: no bound)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.source = f"minLength {lo}" + ("" if hi < 0 else f", maxLength {hi}")

    def next(self, state: int, cp: int) -> int:
        if self.hi < 0:
            return min(state + 1, self.lo)  # past the minimum the count no longer matters
        return state + 1 if state < self.hi else -1

    def accepts(self, state: int) -> bool:
        return state >= self.lo

    def any_in(self, state: int, lo: int, hi: int) -> bool:
        return self.hi < 0 or state < self.hi

    def as_pattern(self) -> Pattern:
        """The same language as a DFA (to combine with a pattern or a format: :meth:`Pattern.__and__`)."""
        return Pattern(f"^[\\s\\S]{{{self.lo},{'' if self.hi < 0 else self.hi}}}$", label=self.source)

    def room(self, state: int) -> int:
        """Characters that may still come (-1: any number)."""
        return -1 if self.hi < 0 else self.hi - state


class LengthBounded:
    """A pattern with a length bound of ``lo`` <= 1 and any ``hi`` (pydantic's ``HttpUrl``: ``format: uri``,
    ``minLength`` 1, ``maxLength`` 2083), without the product automaton (``hi`` + 1 copies of the DFA): state = DFA
    state x (hi + 1) + characters so far, a character taken only where the DFA can still reach a match within the
    room left (its shortest way to one, per DFA state). Exact for ``lo`` <= 1: past the first character every
    match is long enough."""

    def __init__(self, p: Pattern, lo: int, hi: int) -> None:
        if lo > 1 or hi < 0:
            raise ValueError("LengthBounded takes minLength 0 or 1 and a maxLength")
        self.p, self.lo, self.hi, self.width = p, lo, hi, hi + 1
        self.source = f"{p.source} and minLength {lo}, maxLength {hi}"
        far = len(p._next) + 1  # past any shortest way
        dist = [0 if a else far for a in p._accept]
        changed = True
        while changed:  # shortest number of characters to a match (Bellman-Ford over the DFA's rows)
            changed = False
            for d, row in enumerate(p._next):
                best = min((dist[t] + 1 for t in row if t >= 0), default=far)
                if best < dist[d]:
                    dist[d], changed = best, True
        self.dist = dist
        first = any(t >= 0 and 1 + dist[t] <= hi for t in p._next[0])
        if not (first or lo == 0 and p._accept[0]):
            raise ValueError(f"pattern {self.source!r} matches no string")
        self._rows: dict[int, list[int]] = {}

    def next(self, state: int, cp: int) -> int:
        d, c = divmod(state, self.width)
        t = self.p.next(d, cp)
        return -1 if t < 0 or c + 1 + self.dist[t] > self.hi else t * self.width + c + 1

    def accepts(self, state: int) -> bool:
        d, c = divmod(state, self.width)
        return c >= self.lo and self.p.accepts(d)

    def any_in(self, state: int, lo: int, hi: int) -> bool:
        d, c = divmod(state, self.width)
        cuts, row = self.p._cuts, self.p._next[d]
        part = row[bisect.bisect_right(cuts, lo) - 1 : bisect.bisect_right(cuts, hi)]
        return any(t >= 0 and c + 1 + self.dist[t] <= self.hi for t in part)

    def classes(self) -> tuple[list[int], list[int], _LazyRows]:
        """As :meth:`Pattern.classes`, the per-state rows made when first asked for."""
        cuts, of, table = self.p.classes()
        return cuts, of, _LazyRows(self, table)


class _LazyRows:
    """Per state of a :class:`LengthBounded`, the next state by character class (``rows[state][class]``)."""

    def __init__(self, b: LengthBounded, table: list[list[int]]) -> None:
        self.b, self.table, self.rows = b, table, {}

    def __getitem__(self, state: int) -> list[int]:
        row = self.rows.get(state)
        if row is None:
            b = self.b
            d, c = divmod(state, b.width)
            row = [-1 if t < 0 or c + 1 + b.dist[t] > b.hi else t * b.width + c + 1 for t in self.table[d]]
            self.rows[state] = row
        return row


def _has(rs: Ranges, cp: int) -> bool:
    i = bisect.bisect_right(rs, (cp, MAX_CP + 1)) - 1
    return i >= 0 and rs[i][0] <= cp <= rs[i][1]


_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_DATE = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})-" + _MONTH_DAY  # years 0001-9999
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,60}[A-Za-z0-9])?"  # up to 62 characters: 4 labels fit 253
_H16 = r"[0-9a-fA-F]{1,4}"
_IPV6 = "|".join(  # RFC 4291's text forms: 8 groups, or fewer around one "::" (no embedded IPv4)
    [rf"({_H16}:){{7}}{_H16}", rf"({_H16}:){{1,7}}:", rf"{_H16}:(:{_H16}){{1,6}}", rf":(:{_H16}){{1,7}}", "::"]
    + [rf"({_H16}:){{1,{k}}}(:{_H16}){{1,{7 - k}}}" for k in range(2, 7)]
)
_PORT = r"([0-9]|[1-9][0-9]{1,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_PCHAR = r"([A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
# an absolute URI with an authority (RFC 3986): scheme://host[:port][/path][?query][#fragment], the host a DNS name
# or an IPv4 address, no user info
_URI = (rf"[A-Za-z][A-Za-z0-9+.-]{{0,31}}://({_HOST_LABEL}(\.{_HOST_LABEL})*|({_OCTET}\.){{3}}{_OCTET})(:{_PORT})?"
        rf"(/{_PCHAR}*)*(\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?")  # fmt: skip
_D = "[0-9]+"
_DUR_TIME = f"T({_D}H({_D}M({_D}S)?)?|{_D}M({_D}S)?|{_D}S)"
_DUR_DATE = f"({_D}D|{_D}M({_D}D)?|{_D}Y({_D}M({_D}D)?)?)({_DUR_TIME})?"
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": rf"^{_ATOM}(\.{_ATOM})*@{_LABEL}(\.{_LABEL})*\.[A-Za-z]{{2,63}}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "ipv6": f"^({_IPV6})$",
    "hostname": rf"^{_HOST_LABEL}(\.{_HOST_LABEL}){{0,3}}$",
    "duration": f"^P({_DUR_DATE}|{_DUR_TIME}|{_D}W)$",  # RFC 3339 appendix A
    "uri": f"^{_URI}$",
    "ipvanyaddress": rf"^(({_OCTET}\.){{3}}{_OCTET}|{_IPV6})$",  # pydantic's IPvAnyAddress
}
# formats that constrain nothing in a JSON string (pydantic's: SecretStr, bytes, Path): any string is valid
ANY_STRING_FORMATS = frozenset(("password", "binary", "path"))


# Numeric bounds (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``) as patterns over a number's
# JSON text: the numbers written without an exponent (``-?(0|[1-9][0-9]*)(\.[0-9]+)?``, no fraction for integers)
# whose value is within the bounds, every one of them but a negative zero where no negative number is (SmolLM2 wrote
# "-0" for a ``ge=0`` field: the minus sign, once taken, left it nothing else). A magnitude is compared with a bound digit by digit (no
# leading zeros: more integer digits is a larger number), as in any regular expression for a numeric range.
MAX_BOUND_DIGITS = 40
_FRAC = r"(\.[0-9]+)?"


def _digits(m: Decimal) -> tuple[str, str]:
    """A non-negative decimal's integer digits and its fraction's (no trailing zeros)."""
    i, _, f = format(m, "f").partition(".")
    return i, f.rstrip("0")


def _ge(m: Decimal, strict: bool, frac: bool) -> list[str]:
    """Magnitudes (unsigned number texts) >= m (> m where ``strict``), as alternatives."""
    i, f = _digits(m)
    fr, n = _FRAC if frac else "", len(i)
    alts = [f"[1-9][0-9]{{{n},}}{fr}"]  # more integer digits
    for k in range(n):  # the same count, larger at digit k
        if i[k] < "9":
            alts.append(f"{i[:k]}[{int(i[k]) + 1}-9]" + (f"[0-9]{{{n - k - 1}}}" if k < n - 1 else "") + fr)
    if not f:  # the same integer part
        if not strict:
            alts.append(i + fr)
        elif frac:
            alts.append(i + r"\.0*[1-9][0-9]*")
        return alts
    alts += [rf"{i}\.{f[:k]}[{int(f[k]) + 1}-9][0-9]*" for k in range(len(f)) if f[k] < "9"]
    alts.append(rf"{i}\.{f}" + ("0*[1-9][0-9]*" if strict else "[0-9]*"))
    return alts


def _le(m: Decimal, strict: bool, frac: bool) -> list[str]:
    """Magnitudes <= m (< m where ``strict``), as alternatives."""
    i, f = _digits(m)
    fr, n = _FRAC if frac else "", len(i)
    alts = []
    if n > 1:  # fewer integer digits
        alts.append(("[0-9]" if n == 2 else f"(0|[1-9][0-9]{{0,{n - 2}}})") + fr)
    for k in range(n):  # the same count, smaller at digit k (no leading zero)
        low = 1 if k == 0 and n > 1 else 0
        if int(i[k]) - 1 >= low:
            alts.append(f"{i[:k]}[{low}-{int(i[k]) - 1}]" + (f"[0-9]{{{n - k - 1}}}" if k < n - 1 else "") + fr)
    if not f:
        if not strict:
            alts.append(i + (r"(\.0+)?" if frac else ""))
        return alts
    alts.append(i)  # the integer part alone is below
    alts += [rf"{i}\.{f[:k]}[0-{int(f[k]) - 1}][0-9]*" for k in range(len(f)) if f[k] > "0"]
    alts += [rf"{i}\.{f[:k]}" for k in range(1, len(f))]  # a shorter fraction that is a prefix is below
    if not strict:
        alts.append(rf"{i}\.{f}0*")
    return alts


def _alt(alts: list[str]) -> str:
    return "(" + "|".join(alts) + ")" if alts else "[]"


def _zero(frac: bool) -> str:
    return r"0(\.0+)?" if frac else "0"


def _lower(lo: Decimal, strict: bool, frac: bool) -> str:
    """Number texts >= lo (> lo)."""
    mag = "(0|[1-9][0-9]*)" + (_FRAC if frac else "")
    if lo > 0:
        return _alt(_ge(lo, strict, frac))
    if lo == 0:  # no "-0": a minus sign that could only lead to zero would trap a model that wrote it
        return _alt(_ge(lo, True, frac)) if strict else mag
    return f"({mag}|-{_alt(_le(-lo, strict, frac))})"


def _upper(hi: Decimal, strict: bool, frac: bool) -> str:
    """Number texts <= hi (< hi)."""
    mag = "(0|[1-9][0-9]*)" + (_FRAC if frac else "")
    if hi > 0:
        return f"(-{mag}|{_alt(_le(hi, strict, frac))})"
    if hi == 0:
        return f"-{_alt(_ge(hi, True, frac))}" if strict else f"(-{mag}|{_zero(frac)})"
    return f"-{_alt(_ge(-hi, strict, frac))}"


def number_range(lo: Decimal | None, lo_strict: bool, hi: Decimal | None, hi_strict: bool, integer: bool) -> Pattern:
    """The pattern of the JSON number texts without an exponent (integers: without a fraction either) whose value
    is >= ``lo`` (> where ``lo_strict``; None: no bound) and <= ``hi``. ValueError where no number is."""
    given = ((lo, lo_strict, "Minimum"), (hi, hi_strict, "Maximum"))
    names = [f"{'exclusive' + w if x else w.lower()} {b}" for b, x, w in given]
    label = " and ".join(n for n, (b, _, _) in zip(names, given) if b is not None)
    kind = "integer" if integer else "number"
    if any(b is not None and len(format(abs(b), "f").replace(".", "")) > MAX_BOUND_DIGITS for b, _, _ in given):
        raise ValueError(f"{label}: bounds of more than {MAX_BOUND_DIGITS} digits are not supported")
    if integer:  # an integer's bounds as inclusive integers (exact: the context holds every digit)
        with localcontext(prec=2 * MAX_BOUND_DIGITS):
            if lo is not None:
                lo = lo.to_integral_value(ROUND_FLOOR) + 1 if lo_strict else lo.to_integral_value(ROUND_CEILING)
            if hi is not None:
                hi = hi.to_integral_value(ROUND_CEILING) - 1 if hi_strict else hi.to_integral_value(ROUND_FLOOR)
        lo_strict = hi_strict = False
    if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_strict or hi_strict)):
        raise ValueError(f"{label}: no {kind} is within these bounds")
    parts = [Pattern(f"^{f(b, x, not integer)}$", label=n)
             for f, b, x, n in ((_lower, lo, lo_strict, names[0]), (_upper, hi, hi_strict, names[1]))
             if b is not None]  # fmt: skip
    try:
        return parts[0] & parts[1] if len(parts) == 2 else parts[0]
    except ValueError:
        raise ValueError(f"{label}: no {kind} is within these bounds") from None


# the alphabet of a number's text, as intervals: below "-", "-", ".", "/", each digit, then the rest
_NUM_CUTS = [0, 0x2D, 0x2E, 0x2F, *range(0x30, 0x3A), 0x3A]


def multiple_of(m: Decimal, integer: bool) -> Pattern:
    """The pattern of the JSON number texts without an exponent (integers: without a fraction either) whose value
    is an exact multiple of ``m`` (> 0). With m = M / 10^q (M an integer), the DFA keeps the value so far times
    10^(fraction digits read, up to q) modulo M; past q fraction digits only zeros may follow."""
    i, f = _digits(m)
    q, big = len(f), int(i + f)
    label = f"multipleOf {m}"
    if big * (q + 3) > MAX_PRODUCT:
        raise ValueError(f"{label}: too many digits for this automaton (at most {MAX_PRODUCT} states: "
                         f"{big * (q + 3)} needed)")  # fmt: skip
    # states: "start", "-", "0" (a leading zero), ("i", r) integer digits, ("f", r, k) k fraction digits (k up to
    # q + 1: past q, the value no longer changes)

    def step(st: object, lo: int) -> object:
        digit = lo - 0x30 if 0x30 <= lo <= 0x39 else -1
        if st in ("start", "-"):
            if lo == 0x2D and st == "start":
                return "-"
            return "0" if digit == 0 else ("i", digit % big) if digit > 0 else None
        if lo == 0x2E and not integer and (st == "0" or st[0] == "i"):  # type: ignore[index]
            return ("f", 0 if st == "0" else st[1], 0)  # type: ignore[index]
        if digit < 0 or st == "0":
            return None
        if st[0] == "i":  # type: ignore[index]
            return ("i", (10 * st[1] + digit) % big)  # type: ignore[index]
        _, r, k = st  # type: ignore[misc]
        if k < q:
            return ("f", (10 * r + digit) % big, k + 1)
        return ("f", r, q + 1) if digit == 0 else None

    def accepts(st: object) -> bool:
        if st == "0":
            return True
        if st in ("start", "-"):
            return False
        if st[0] == "i":  # type: ignore[index]
            return st[1] * 10**q % big == 0  # type: ignore[index]
        _, r, k = st  # type: ignore[misc]
        return k > 0 and r * 10 ** (q - min(k, q)) % big == 0

    return Pattern.from_dfa(label, _NUM_CUTS, "start", step, accepts)
