"""JSON mode: output constrained to one JSON object, over a tree's rows, exactly as plain decoding constrains it.

A request in JSON mode (OpenAI's ``response_format: {"type": "json_object"}``) samples each token from the model's
distribution with every token that cannot continue a JSON object removed (its logit set to -inf before
temperature, top-k and top-p, as vLLM's structured output does), and ends with an EOS token once the object is
closed. Speculative decoding keeps this exact: each tree row predicts the position after its own path, so its row
is constrained by the automaton's state after the committed tokens and that path.

The pieces:

- :class:`JsonGrammar`: a byte-level pushdown automaton for RFC 8259 JSON (an object at the top level; UTF-8
  checked as the Unicode standard's table of well-formed byte sequences; at most :data:`MAX_DEPTH` nested
  containers and :data:`MAX_WS` whitespace bytes in a row, so a model cannot loop on blank lines) over one
  vocabulary's token bytes. A state is a small tuple; :meth:`JsonGrammar.advance` runs a token's bytes through
  it. :meth:`JsonGrammar.allowed` is the mask of tokens that can follow a state: a walk of the vocabulary's byte
  trie that leaves dead branches at their first bad byte (outside strings few branches live), and inside a string
  a per-UTF-8-state table of the tokens that stay in it plus a walk of the few that hold a quote or a backslash;
  masks are kept per state (JSON's states repeat).
- :func:`prune`: drops the draft tokens that the automaton refuses (their rows could never be accepted) before the
  forward, so they cost no rows.
- :func:`constrain_`: constrains a step's rows in place, with an undo (reported logprobs stay the model's own, as
  with :mod:`treedraft.penalties`). A greedy row whose argmax the automaton allows is left alone (masking cannot
  change that argmax), so a greedy step costs one token's check per row and a whole mask only where the model
  leaves JSON; sampled rows are masked whole.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import operator
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from .interfaces import GenerationError
from .pattern import ANY_STRING_FORMATS, FORMATS, Length, LengthBounded, Pattern, multiple_of, number_range
from .tree import TokenTree

MAX_DEPTH = 32  # nested objects / arrays
MAX_WS = 32  # whitespace bytes in a row between tokens of the JSON text
LONG_LENGTH = 64  # a maxLength from here on (with minLength 0 or 1) beside a pattern: LengthBounded, not a product

# modes. A state is (mode, a, b, stack); stack: a tuple of the open containers' frames, ("{", schema node, keys seen
# (bitmask; in a free object: the keys written, counted up to its bounds), the key being written or -1) for objects
# and ("[", schema node, the values started, counted up to its bounds) for arrays
(
    START,
    VALUE,
    ARR_FIRST,
    OBJ_FIRST,
    KEY,
    COLON,
    AFTER,
    STR,
    ESC,
    UHEX,
    NUM,
    LIT,
    KSTR,
    ENUM,
    PSTR,
    PESC,
    PUHEX,
    PNUM,
    MULTI,
    DONE,
    END,
) = range(21)
# structural modes: a = the whitespace bytes just read (START: b = the root's schema node)
# STR: a = 1 in a free object's key, 0 in a value; b = the UTF-8 state below.  ESC: a as STR, b = 0, or (a high
# surrogate, 0 or 1: its pair's backslash read) (surrogates only in pairs: a lone one is no Unicode text).  UHEX: a as
# STR, b = (hex digits left, value so far, the high surrogate it pairs with or 0).  NUM: a = the number state below, b = 1 for integers only.  LIT: a = the literal's bytes still to
# come.  KSTR: a declared key being written, a = its bytes so far.  ENUM: a = the value's bytes so far, b = its node.
# PSTR: a string value under a pattern / format, a = its DFA state (:mod:`treedraft.pattern`), b = (its node, the
# UTF-8 state below, the code point's bits so far).  PESC: a as PSTR, b = (node, a high surrogate's code point or 0,
# 0 or 1: its second escape's backslash read).  PUHEX: a as PSTR, b = (node, hex digits left, value so far, high
# surrogate or 0).  PNUM: a number under bounds or a step, a = its DFA state (:func:`treedraft.pattern.number_range`,
# :func:`treedraft.pattern.multiple_of`), b = its node.  MULTI: inside a value that several anyOf branches of one
# JSON type could still be, a = the frozenset of the states (one per live branch; nested ones flattened), each stepped
# alike until one is left.  DONE: the object is closed (EOS only); END: after that EOS (EOS only: drafts beyond it
# are never delivered)

# UTF-8 inside strings: b = 0 (at a character boundary) or the continuation still needed and its allowed first byte
# (the Unicode standard's table 3-7 of well-formed sequences: no overlongs, surrogates or code points past U+10FFFF)
_UTF8_RANGE = {1: (0x80, 0xBF), 2: (0x80, 0xBF), 3: (0xA0, 0xBF), 4: (0x80, 0x9F), 5: (0x80, 0xBF), 6: (0x90, 0xBF),
               7: (0x80, 0x8F)}  # fmt: skip
_UTF8_NEXT = {1: 0, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2}
_UTF8_LEAD = [-1] * 256
for _c in range(0xC2, 0xE0):
    _UTF8_LEAD[_c] = 1
for _c in range(0xE1, 0xF0):
    _UTF8_LEAD[_c] = 2
_UTF8_LEAD[0xE0], _UTF8_LEAD[0xED] = 3, 4
for _c in range(0xF1, 0xF4):
    _UTF8_LEAD[_c] = 5
_UTF8_LEAD[0xF0], _UTF8_LEAD[0xF4] = 6, 7

# number states: after "-", after a leading 0, in the integer digits, after ".", in the fraction, after e/E, after
# the exponent's sign, in the exponent; a number may end (any other byte) in ZERO, INT, FRAC and EXP
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(8)
_N_END = frozenset((N_ZERO, N_INT, N_FRAC, N_EXP))
_DIGITS = frozenset(b"0123456789")
_NUM_BYTES = frozenset(b"0123456789.-+eE")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_WS = frozenset(b" \t\n\r")
_ESCAPED = frozenset(b'"\\/bfnrt')

State = tuple
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
NEVER = MAX_DEPTH + 1  # container levels no instance can stay within (an impossible value)

# the JSON value classes, by a value's first byte: object, array, string, number, boolean, null (anyOf / oneOf
# branches must differ in class: the first byte then says which branch a value takes)
_CLASS_NAMES = ("objects", "arrays", "strings", "numbers", "booleans", "null")
_CLASS = [-1] * 256
for _c, _k in ((0x7B, 0), (0x5B, 1), (0x22, 2), (0x2D, 3), (0x74, 4), (0x66, 4), (0x6E, 5)):
    _CLASS[_c] = _k
for _c in b"0123456789":
    _CLASS[_c] = 3
_TYPE_CLASS = {"object": 0, "array": 1, "string": 2, "number": 3, "integer": 3, "boolean": 4, "null": 5}


@dataclass(frozen=True)
class SchemaNode:
    """One schema of a compiled JSON Schema (:func:`compile_schema`). ``keys``: the declared properties' names as
    their JSON text (escaped UTF-8, no quotes), the only keys its objects take unless ``free`` (no ``properties``:
    any keys, each value of node ``extra``, the ``additionalProperties`` schema; -1: no keys at all). ``required``:
    bitmask over ``keys``. ``enum``: the allowed values' compact JSON texts (None: any of ``types``). Arrays hold
    ``min_items``..``max_items`` (-1: no bound) values, of the nodes in ``prefix`` first, then of node ``items``; objects ``min_props``..``max_props``
    keys; strings match ``pattern`` (``pattern`` / ``format``) if given, numbers ``numeric`` (bounds, step).
    ``dispatch`` (anyOf / oneOf): the nodes that take a value of each class (:data:`_CLASS`; () none, several:
    followed side by side, a MULTI state), the automaton never enters the union itself.
    ``need``: the fewest nested containers an instance opens (:data:`NEVER`: none fits), ``obj_need`` /
    ``arr_need`` those of its objects / arrays: a container opens only where that many levels are left, and an
    optional key or another array item only where its value fits, so no state is a dead end."""

    types: frozenset[str] = frozenset(TYPES)
    keys: tuple[bytes, ...] = ()
    values: tuple[int, ...] = ()
    required: int = 0
    items: int = 0
    enum: tuple[bytes, ...] | None = None
    free: bool = True
    extra: int = 0
    min_items: int = 0
    max_items: int = -1
    min_props: int = 0
    max_props: int = -1
    dispatch: tuple[tuple[int, ...], ...] | None = None
    prefix: tuple[int, ...] = ()
    unique: bool = False
    pattern: Pattern | Length | LengthBounded | None = None
    numeric: Pattern | None = None
    need: int = 0
    obj_need: int = 1
    arr_need: int = 1


ANY = (SchemaNode(),)  # json_object: node 0 is any JSON value (an object at the top)


def _close(stack: tuple) -> State:
    rest = stack[:-1]
    return (AFTER, 0, 0, rest) if rest else (DONE, 0, 0, ())


def _item_node(node: SchemaNode, i: int) -> int:
    """The schema node of an array's item ``i`` (from 0): ``prefixItems``' own, then ``items``."""
    return node.prefix[i] if 0 <= i < len(node.prefix) else node.items


def _value_node(stack: tuple, nodes: Sequence[SchemaNode]) -> int:
    """The schema node of the value that starts here (in the innermost container)."""
    top = stack[-1]
    if top[0] == "[":
        return _item_node(nodes[top[1]], top[2] - 1)
    node = nodes[top[1]]
    return node.extra if node.free else node.values[top[3]]


def _value(c: int, stack: tuple, n: int, nodes: Sequence[SchemaNode]) -> State | None:
    """The state after byte ``c`` where a value of schema node ``n`` starts."""
    node = nodes[n]
    if node.dispatch is not None:  # anyOf / oneOf: the branch(es) that take this class of value
        k = _CLASS[c]
        branches = node.dispatch[k] if k >= 0 else ()
        if len(branches) != 1:  # none, or several followed side by side until the value tells them apart
            return _alternatives([_value(c, stack, b, nodes) for b in branches])
        n = branches[0]
        node = nodes[n]
    if node.enum is not None:
        p = bytes([c])
        return (ENUM, p, n, stack) if any(e.startswith(p) for e in node.enum) else None
    t = node.types
    if c == 0x22:  # "
        if "string" not in t:
            return None
        return (STR, 0, 0, stack) if node.pattern is None else (PSTR, 0, (n, 0, 0), stack)
    if c in _DIGITS or c == 0x2D:  # a digit, -
        if "number" not in t and "integer" not in t:
            return None
        if node.numeric is not None:
            d = node.numeric.next(0, c)
            return (PNUM, d, n, stack) if d >= 0 else None
        sub = N_MINUS if c == 0x2D else N_ZERO if c == 0x30 else N_INT
        return (NUM, sub, int("number" not in t), stack)
    if c == 0x7B:  # {
        if "object" not in t or len(stack) + node.obj_need > MAX_DEPTH:
            return None
        return (OBJ_FIRST, 0, 0, (*stack, ("{", n, 0, -1)))
    if c == 0x5B:  # [
        if "array" not in t or len(stack) + node.arr_need > MAX_DEPTH:
            return None
        frame = ("[", n, 0, frozenset(), b"") if node.unique else ("[", n, 0)  # uniqueItems: the items so far
        return (ARR_FIRST, 0, 0, (*stack, frame))
    if (c == 0x74 or c == 0x66) and "boolean" in t:  # t f
        return (LIT, b"rue" if c == 0x74 else b"alse", 0, stack)
    if c == 0x6E and "null" in t:  # n
        return (LIT, b"ull", 0, stack)
    return None


MAX_ALTERNATIVES = 64  # anyOf branches alive at once (nested unions multiply)


def _alternatives(states: Sequence[State | None]) -> State | None:
    """The state of a value that any of ``states`` may continue (None where none can): MULTI states flattened, dead
    and repeated ones dropped (branches that agree again, e.g. after their value, merge)."""
    alive: set[State] = set()
    for x in states:
        if x is None:
            continue
        if x[0] == MULTI:
            alive.update(x[1])
        else:
            alive.add(x)
    if len(alive) <= 1:
        return next(iter(alive), None)
    if len(alive) > MAX_ALTERNATIVES:
        raise GenerationError(f"JSON Schema: more than {MAX_ALTERNATIVES} anyOf branches alive at once; make the "
                              "branches tell themselves apart sooner (e.g. a distinct first key)")  # fmt: skip
    return (MULTI, frozenset(alive), 0, ())


def _number(s: State, c: int, nodes: Sequence[SchemaNode]) -> State | None:
    n, integer, stack = s[1], s[2], s[3]
    digit = c in _DIGITS
    if n == N_MINUS:
        return (NUM, N_ZERO if c == 0x30 else N_INT, integer, stack) if digit else None
    if n == N_INT and digit:
        return s
    if n in (N_ZERO, N_INT) and c == 0x2E and not integer:  # .
        return (NUM, N_DOT, 0, stack)
    if n in (N_ZERO, N_INT, N_FRAC) and c in (0x65, 0x45) and not integer:  # e E
        return (NUM, N_E, 0, stack)
    if n in (N_DOT, N_FRAC) and digit:
        return (NUM, N_FRAC, 0, stack)
    if n == N_E and c in (0x2B, 0x2D):  # + -
        return (NUM, N_ESIGN, 0, stack)
    if n in (N_E, N_ESIGN, N_EXP) and digit:
        return (NUM, N_EXP, 0, stack)
    if n in _N_END and not digit:  # the number ended: this byte follows a value ("01" is no number)
        return step((AFTER, 0, 0, stack), c, nodes)
    return None


def _key(stack: tuple, nodes: Sequence[SchemaNode]) -> State:
    """The state after a key's opening quote: a declared key, or any string in a free object."""
    return (STR, 1, 0, stack) if nodes[stack[-1][1]].free else (KSTR, b"", 0, stack)


def _count(frame: tuple, node: SchemaNode) -> int:
    """The keys an object has written (a free object counts them in the frame)."""
    return frame[2] if node.free else frame[2].bit_count()


def _free_key(stack: tuple, nodes: Sequence[SchemaNode]) -> tuple:
    """The stack with one more key written in its innermost (free) object, counted up to its bounds."""
    f = stack[-1]
    node = nodes[f[1]]
    if f[2] >= max(node.min_props, node.max_props):
        return stack
    return (*stack[:-1], (f[0], f[1], f[2] + 1, f[3]))


def _open_keys(frame: tuple, depth: int, nodes: Sequence[SchemaNode]) -> list[int]:
    """The declared keys the object in ``frame`` (at stack depth ``depth``) may still take: not written yet, a value
    that fits in the levels left, and, where ``max_props`` leaves room for no more than the required keys still
    missing, only those."""
    node = nodes[frame[1]]
    seen = frame[2]
    only_required = node.max_props >= 0 and _count(frame, node) + (node.required & ~seen).bit_count() >= node.max_props
    return [
        i for i, v in enumerate(node.values)
        if not seen >> i & 1 and depth + nodes[v].need <= MAX_DEPTH and (not only_required or node.required >> i & 1)
    ]  # fmt: skip


def _declared_key(s: State, c: int, nodes: Sequence[SchemaNode]) -> State | None:
    prefix, stack = s[1], s[3]
    _, n, seen, _ = frame = stack[-1]
    keys = nodes[n].keys
    open_keys = _open_keys(frame, len(stack), nodes)
    if c == 0x22 and (len(prefix) - len(prefix.rstrip(b"\\"))) % 2 == 0:  # the key ends (no escaped quote)
        for i in open_keys:
            if keys[i] == prefix:
                return (COLON, 0, 0, (*stack[:-1], (frame[0], n, seen | 1 << i, i)))
        return None
    p = prefix + bytes([c])
    return (KSTR, p, 0, stack) if any(keys[i].startswith(p) for i in open_keys) else None


def _closes(frame: tuple, nodes: Sequence[SchemaNode]) -> bool:
    """An object may close here: every required key written, and at least ``min_props`` keys."""
    node = nodes[frame[1]]
    if node.free:
        return frame[2] >= node.min_props
    return frame[2] & node.required == node.required and frame[2].bit_count() >= node.min_props


def _more_keys(stack: tuple, nodes: Sequence[SchemaNode]) -> bool:
    """The innermost object may take another key: any key of a free one (if its values fit), or a declared key
    not written yet."""
    frame = stack[-1]
    node = nodes[frame[1]]
    if node.free:
        room = node.max_props < 0 or frame[2] < node.max_props
        return room and node.extra >= 0 and len(stack) + nodes[node.extra].need <= MAX_DEPTH
    return bool(_open_keys(frame, len(stack), nodes))


def _more_items(stack: tuple, nodes: Sequence[SchemaNode]) -> bool:
    """The innermost array may take another value: below ``max_items``, and its schema has an instance that fits in
    the levels left (``items: false`` past ``prefixItems`` has none)."""
    n, count = stack[-1][1], stack[-1][2]
    node = nodes[n]
    if node.max_items >= 0 and count >= node.max_items:
        return False
    return len(stack) + nodes[_item_node(node, count)].need <= MAX_DEPTH


def _item(stack: tuple, nodes: Sequence[SchemaNode]) -> tuple:
    """The stack with one more value in its innermost array (counted up to the larger bound: past it counts no
    longer matter, and the states stay few)."""
    f = stack[-1]
    n, count = f[1], f[2]
    node = nodes[n]
    cap = max(node.min_items, node.max_items, len(node.prefix) + 1 if node.prefix else 0)
    return stack if count >= cap else (*stack[:-1], ("[", n, count + 1, *f[3:]))


_ESCAPE_CHAR = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 0x08, 0x66: 0x0C, 0x6E: 0x0A, 0x72: 0x0D, 0x74: 0x09}
_UTF8_BITS = {1: 0x1F, 2: 0x0F, 3: 0x0F, 4: 0x0F, 5: 0x07, 6: 0x07, 7: 0x07}  # a lead byte's bits, by its state


def _char(s: State, cp: int, nodes: Sequence[SchemaNode]) -> State | None:
    """A patterned string after its next character ``cp``."""
    n = s[2][0]
    d = nodes[n].pattern.next(s[1], cp)  # type: ignore[union-attr]
    return None if d < 0 else (PSTR, d, (n, 0, 0), s[3])


def _utf8_live(p: Pattern, d: int, utf8: int, cp: int) -> bool:
    """Whether some character that the UTF-8 sequence so far (its bits ``cp``, state ``utf8``) can still become
    continues the pattern from DFA state ``d`` (else its bytes would lead into a dead end)."""
    more = 0
    u = utf8
    while u:
        more, u = more + 1, _UTF8_NEXT[u]
    lo, hi = _UTF8_RANGE[utf8]
    shift = 6 * (more - 1)
    return p.any_in(d, (cp << 6 | lo & 0x3F) << shift, (cp << 6 | hi & 0x3F) << shift | (1 << shift) - 1)


def _hex_live(p: Pattern | Length | _AnyChar, d: int, v: int, left: int, high: int) -> bool:
    """The same for a \\u escape with value ``v`` so far and ``left`` hex digits to come (``high``: the high
    surrogate whose low half this is): its BMP characters, and the astral ones of the high surrogates it can be."""
    span = 1 << 4 * left
    lo, hi = v * span, v * span + span - 1
    if high:
        lo, hi = max(lo, 0xDC00), min(hi, 0xDFFF)
        base = 0x10000 + (high - 0xD800 << 10) - 0xDC00
        return lo <= hi and p.any_in(d, base + lo, base + hi)
    if lo <= 0xD7FF and p.any_in(d, lo, min(hi, 0xD7FF)):
        return True
    if hi >= 0xE000 and p.any_in(d, max(lo, 0xE000), hi):
        return True
    a, b = max(lo, 0xD800), min(hi, 0xDBFF)
    return a <= b and p.any_in(d, 0x10000 + (a - 0xD800 << 10), 0x10000 + (b - 0xD800 << 10) + 0x3FF)


class _AnyChar:
    """The pattern of a free string: any character may come."""

    @staticmethod
    def any_in(state: int, lo: int, hi: int) -> bool:
        return True


_ANY_CHAR = _AnyChar()


def _uhex(c: int, left: int, v: int, high: int, p: Pattern | Length | _AnyChar = _ANY_CHAR, d: int = 0):
    """A \\u escape's next byte ``c`` (``left`` hex digits were to come, ``v`` so far; ``high``: the high surrogate
    whose low half this is, or 0), in any string (``p``, ``d``: a pattern and its DFA state). Returns None where
    refused (a lone surrogate, or only characters ``p`` refuses can follow), (digits left, value) while digits
    remain, else the code point: a character, or a high surrogate whose low half must follow."""
    if c not in _HEX:
        return None
    v, left = v << 4 | int(chr(c), 16), left - 1
    if left or 0xD800 <= v <= 0xDBFF:
        return ((left, v) if left else v) if _hex_live(p, d, v, left, high) else None
    return 0x10000 + (high - 0xD800 << 10) + (v - 0xDC00) if high else v  # (a low half alone: refused above)


def _patterned(s: State, c: int, nodes: Sequence[SchemaNode]) -> State | None:
    """A string under a pattern: its characters (literal UTF-8 or JSON escapes; surrogates only as a \\u pair)
    run through the pattern's DFA, the closing quote only where it matches, and no byte that only leads to
    characters the pattern refuses there (so no dead end)."""
    mode, d, b, stack = s
    p: Pattern = nodes[b[0]].pattern  # type: ignore[assignment]
    if mode == PSTR:
        n, utf8, cp = b
        if utf8:
            lo, hi = _UTF8_RANGE[utf8]
            if not lo <= c <= hi:
                return None
            cp = cp << 6 | c & 0x3F
            nxt = _UTF8_NEXT[utf8]
            if not nxt:
                return _char(s, cp, nodes)
            return (PSTR, d, (n, nxt, cp), stack) if _utf8_live(p, d, nxt, cp) else None
        if c == 0x22:
            return (AFTER, 0, 0, stack) if p.accepts(d) else None
        if c == 0x5C:
            return (PESC, d, (n, 0, 0), stack) if _hex_live(p, d, 0, 4, 0) else None
        if c < 0x20:
            return None
        if c < 0x80:
            return _char(s, c, nodes)
        lead = _UTF8_LEAD[c]
        if lead < 0 or not _utf8_live(p, d, lead, c & _UTF8_BITS[lead]):
            return None
        return (PSTR, d, (n, lead, c & _UTF8_BITS[lead]), stack)
    if mode == PESC:
        n, high, slash = b
        if high:  # a high surrogate's escape read: only its low half's "\\u" may follow
            if not slash:
                return (PESC, d, (n, high, 1), stack) if c == 0x5C else None
            return (PUHEX, d, (n, 4, 0, high), stack) if c == 0x75 else None
        if c == 0x75:  # u
            return (PUHEX, d, (n, 4, 0, 0), stack)
        ch = _ESCAPE_CHAR.get(c)
        return None if ch is None else _char((PSTR, d, (n, 0, 0), stack), ch, nodes)
    n, left, v, high = b
    r = _uhex(c, left, v, high, p, d)
    if r is None:
        return None
    if isinstance(r, tuple):
        return (PUHEX, d, (n, *r, high), stack)
    if 0xD800 <= r <= 0xDBFF:  # a high surrogate: its pair's second half must follow
        return (PESC, d, (n, r, 0), stack)
    return _char((PSTR, d, (n, 0, 0), stack), r, nodes)


def step(s: State, c: int, nodes: Sequence[SchemaNode] = ANY) -> State | None:
    """The automaton's state after byte ``c`` (0..255), or None where no JSON object (of ``nodes``' schema)
    continues so."""
    stack = s[3]
    if stack and len(stack[-1]) == 5:  # in a uniqueItems array (of scalars: its frame is innermost throughout)
        return _unique_step(s, c, nodes)
    return _step(s, c, nodes)


# modes inside a scalar item; of them, those whose value ends on the byte after it (which is not part of it)
_ITEM_MODES = frozenset((STR, ESC, UHEX, NUM, LIT, ENUM))
_ENDS_AFTER = frozenset((NUM, ENUM))


def _canon(text: bytes) -> tuple:
    """A scalar's JSON text as its value for uniqueItems: numbers equal by value (1 = 1.0), never equal to a
    boolean."""
    v = json.loads(text)
    if isinstance(v, str):
        return ("s", v)
    if v is None or isinstance(v, bool):
        return ("l", v)
    return ("n", Decimal(text.decode()))  # exact, equal and hashed by value (1e30000000 stays small)


_ZERO = _canon(b"0")


def _finite_values(node: SchemaNode) -> set[tuple] | None:
    """The values (as :func:`_canon`) an item of scalar schema ``node`` can take, or None where there is no end to
    them (free strings and numbers)."""
    if node.enum is not None:
        return {_canon(e) for e in node.enum}
    if {"string", "number", "integer"} & node.types:
        return None
    return {_canon(t) for t in [b"true", b"false"] * ("boolean" in node.types) + [b"null"] * ("null" in node.types)}


def _unique_left(node: SchemaNode, seen: frozenset) -> bool:
    """Whether an item of schema ``node`` not in ``seen`` exists (free strings and numbers: always)."""
    values = _finite_values(node)
    return values is None or not values <= seen


def _unique_step(s: State, c: int, nodes: Sequence[SchemaNode]) -> State | None:
    """``_step`` in a uniqueItems array, its frame ("[", node, count, the items' values so far, the current item's
    text): an item that ends equal to an earlier one is refused, and so is any byte after which every way the item
    (or, after a comma, the next one) can go is an earlier value, so that no state dead-ends."""
    f = s[3][-1]
    ns = _step(s, c, nodes)
    if ns is None:
        return None
    mode, depth = s[0], len(s[3])
    seen, cur = f[3], f[4]
    items = nodes[nodes[f[1]].items]
    inside = ns[0] in _ITEM_MODES and len(ns[3]) == depth
    if mode in _ITEM_MODES:
        if inside:
            cur += bytes([c])
        else:  # the item ended: with this byte (a quote, a literal's last letter) or before it (a number, an enum)
            key = _canon(cur if mode in _ENDS_AFTER else cur + bytes([c]))
            if key in seen:
                return None
            seen, cur = seen | {key}, b""
    elif inside:  # this byte starts an item
        cur = bytes([c])
    if len(ns[3]) < depth:  # the array closed
        return ns
    if ns[0] == VALUE and s[0] != VALUE and not _unique_left(items, seen):
        return None  # a comma with no value left that is not an earlier one
    if inside and not _open(ns, items, seen, cur):
        return None
    g = ns[3][-1]
    return (ns[0], ns[1], ns[2], (*ns[3][:-1], (g[0], g[1], g[2], seen, cur)))


def _open(ns: State, node: SchemaNode, seen: frozenset, cur: bytes) -> bool:
    """Whether the item begun as ``cur`` (state ``ns``) can still end as a value not in ``seen``: a literal is
    fixed by its first letter, an enum value by the values its text begins, an integer that began with 0 is 0; a
    string or any other number can still be made longer."""
    if ns[0] == LIT:
        return _canon({0x74: b"true", 0x66: b"false", 0x6E: b"null"}[cur[0]]) not in seen
    if ns[0] == ENUM:
        return any(e.startswith(ns[1]) and _canon(e) not in seen for e in node.enum)  # type: ignore[union-attr]
    if ns[0] == NUM and ns[1] == N_ZERO and ns[2]:
        return _ZERO not in seen
    if ns[0] == NUM and ns[1] in (N_E, N_ESIGN, N_EXP):  # an exponent on a zero mantissa: 0 whatever follows
        mantissa = cur.replace(b"E", b"e").split(b"e")[0]
        return Decimal(mantissa.decode()) != 0 or _ZERO not in seen
    return True


def _step(s: State, c: int, nodes: Sequence[SchemaNode] = ANY) -> State | None:
    mode = s[0]
    if mode == STR:
        b = s[2]
        if b == 0:
            if c == 0x22:  # the string ends: a key wants its colon, a value what follows values
                return (COLON, 0, 0, _free_key(s[3], nodes)) if s[1] else (AFTER, 0, 0, s[3])
            if c == 0x5C:
                return (ESC, s[1], 0, s[3])
            if c < 0x20:
                return None  # control characters must be escaped
            if c < 0x80:
                return s
            lead = _UTF8_LEAD[c]
            return None if lead < 0 else (STR, s[1], lead, s[3])
        lo, hi = _UTF8_RANGE[b]
        return (STR, s[1], _UTF8_NEXT[b], s[3]) if lo <= c <= hi else None
    if mode == NUM:
        return _number(s, c, nodes)
    if mode == PSTR or mode == PESC or mode == PUHEX:
        return _patterned(s, c, nodes)
    if mode == PNUM:  # a bounded number: its bytes through the range's DFA, its end only where that accepts
        p: Pattern = nodes[s[2]].numeric  # type: ignore[assignment]
        if c in _NUM_BYTES:
            d = p.next(s[1], c)
            return (PNUM, d, s[2], s[3]) if d >= 0 else None
        return step((AFTER, 0, 0, s[3]), c, nodes) if p.accepts(s[1]) else None
    if mode == KSTR:
        return _declared_key(s, c, nodes)
    if mode == ENUM:
        p = s[1] + bytes([c])
        enum = nodes[s[2]].enum
        if any(e.startswith(p) for e in enum):
            return (ENUM, p, s[2], s[3])
        return step((AFTER, 0, 0, s[3]), c, nodes) if s[1] in enum else None
    if mode == ESC:
        if s[2]:  # a high surrogate's escape read: only its low half's "\\u" may follow
            high, slash = s[2]
            if not slash:
                return (ESC, s[1], (high, 1), s[3]) if c == 0x5C else None
            return (UHEX, s[1], (4, 0, high), s[3]) if c == 0x75 else None
        if c in _ESCAPED:
            return (STR, s[1], 0, s[3])
        return (UHEX, s[1], (4, 0, 0), s[3]) if c == 0x75 else None  # u
    if mode == UHEX:
        high = s[2][2]
        r = _uhex(c, *s[2])
        if r is None:
            return None
        if isinstance(r, tuple):
            return (UHEX, s[1], (*r, high), s[3])
        return (ESC, s[1], (r, 0), s[3]) if 0xD800 <= r <= 0xDBFF else (STR, s[1], 0, s[3])
    if mode == LIT:
        rest = s[1]
        if c != rest[0]:
            return None
        return (LIT, rest[1:], 0, s[3]) if len(rest) > 1 else (AFTER, 0, 0, s[3])
    if mode == MULTI:
        return _alternatives([step(x, c, nodes) for x in s[1]])
    if mode >= DONE:
        return None
    stack = s[3]
    if c in _WS:
        return None if s[1] >= MAX_WS else (mode, s[1] + 1, s[2], stack)
    if mode == AFTER:
        top = stack[-1]
        if top[0] == "[":
            if c == 0x2C:  # ,
                return (VALUE, 0, 0, _item(stack, nodes)) if _more_items(stack, nodes) else None
            return _close(stack) if c == 0x5D and top[2] >= nodes[top[1]].min_items else None
        if c == 0x2C:
            return (KEY, 0, 0, stack) if _more_keys(stack, nodes) else None
        return _close(stack) if c == 0x7D and _closes(top, nodes) else None
    if mode == VALUE:
        return _value(c, stack, _value_node(stack, nodes), nodes)
    if mode == COLON:
        return (VALUE, 0, 0, stack) if c == 0x3A else None
    if mode == KEY:
        return _key(stack, nodes) if c == 0x22 else None
    if mode == OBJ_FIRST:
        if c == 0x22:
            return _key(stack, nodes) if _more_keys(stack, nodes) else None
        return _close(stack) if c == 0x7D and _closes(stack[-1], nodes) else None
    if mode == ARR_FIRST:
        if c == 0x5D:
            return _close(stack) if nodes[stack[-1][1]].min_items == 0 else None
        if not _more_items(stack, nodes):
            return None
        stack = _item(stack, nodes)
        return _value(c, stack, _value_node(stack, nodes), nodes)
    # START: whitespace, then the object (of the root's branches, at a union)
    return _value(c, (), s[2], nodes) if c == 0x7B else None


def run(s: State | None, data: bytes, nodes: Sequence[SchemaNode] = ANY) -> State | None:
    """``step`` over every byte of ``data`` (None once refused)."""
    for c in data:
        if s is None:
            return None
        s = step(s, c, nodes)
    return s


_ANNOTATIONS = frozenset(
    ("title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
     "readOnly", "writeOnly", "deprecated", "discriminator")
)  # fmt: skip
_KEYWORDS = frozenset(
    ("type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const",
     "prefixItems", "additionalItems", "propertyNames", "uniqueItems",
     "minProperties", "maxProperties", "pattern", "format", "minLength", "maxLength", "anyOf", "oneOf", "allOf",
     "$ref", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
)  # fmt: skip
_SCALARS = ("string", "number", "integer", "boolean", "null")


def _conforms_type(v: object, types: Sequence[str]) -> bool:
    """Whether an enum / const value is of one of ``types``."""
    kind = {bool: "boolean", str: "string", type(None): "null", float: "number"}.get(type(v))
    if isinstance(v, int) and not isinstance(v, bool):
        return "integer" in types or "number" in types
    if kind == "number" and float(v).is_integer() and "integer" in types:
        return True
    return kind in types


_NUMERIC = frozenset(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))


def _exact(v: int | float) -> Decimal:
    """A schema's JSON number as the exact decimal it was written as (a float by its shortest repr: 0.1 is 0.1)."""
    return Decimal(v) if isinstance(v, int) else Decimal(repr(v))


def _numeric(sch: dict, where: str) -> tuple | None:
    """``minimum`` / ``exclusiveMinimum`` / ``maximum`` / ``exclusiveMaximum`` / ``multipleOf`` as (low or None, low
    exclusive, high or None, high exclusive, the step or None) in exact decimals (None: none given). A numeric
    exclusive bound beside the inclusive one: the tighter applies; a boolean one (draft 4) makes ``minimum`` /
    ``maximum`` exclusive."""
    if not _NUMERIC & set(sch):
        return None
    out: list = []
    for inc, exc, tighter in (("minimum", "exclusiveMinimum", max), ("maximum", "exclusiveMaximum", min)):
        vals = {}
        for kw in (inc, exc):
            v = sch.get(kw)
            if v is None or kw == exc and isinstance(v, bool):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"json_schema at {where}: {kw} must be a number, got {v!r}")
            vals[kw] = _exact(v) + 0  # + 0: -0.0 is 0
        flag = sch.get(exc)
        if isinstance(flag, bool) and flag and inc not in vals:
            raise ValueError(f"json_schema at {where}: {exc}: true needs {inc} (draft 4's form), or give {exc} a "
                             "number")  # fmt: skip
        if not vals:
            out += [None, False]
            continue
        b = tighter(vals.values())
        out += [b, exc in vals and vals[exc] == b or flag is True and vals.get(inc) == b and exc not in vals]
    m = sch.get("multipleOf")
    if m is not None:
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"json_schema at {where}: multipleOf must be a number above 0, got {m!r}")
        m = _exact(m)
    return (*out, m)


def _numeric_pattern(spec: tuple, integer: bool) -> Pattern:
    """The DFA of the number texts :func:`_numeric`'s constraints allow (bounds and step intersected)."""
    lo, lo_x, hi, hi_x, m = spec
    parts = [number_range(lo, lo_x, hi, hi_x, integer)] if lo is not None or hi is not None else []
    parts += [multiple_of(m, integer)] if m is not None else []
    return functools.reduce(operator.and_, parts)


def _within(v: object, spec: tuple | None) -> bool:
    """Whether an enum / const value meets :func:`_numeric`'s constraints (not a number: they do not apply)."""
    if spec is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return True
    x = _exact(v)
    lo, lo_x, hi, hi_x, m = spec
    if m is not None and (Fraction(x) / Fraction(m)).denominator != 1:  # (schema values: no runaway exponents)
        return False
    return (lo is None or (x > lo if lo_x else x >= lo)) and (hi is None or (x < hi if hi_x else x <= hi))


def _length_bounds(sch: dict, where: str) -> tuple[int, int]:
    """A string schema's (minLength, maxLength; -1: none), checked: non-negative integers, min not above max."""
    lo, hi = sch.get("minLength", 0), sch.get("maxLength", -1)
    for kw, v in (("minLength", lo), ("maxLength", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or (kw in sch and v < 0):
            raise ValueError(f"json_schema at {where}: {kw} must be a non-negative integer, got {v!r}")
    if 0 <= hi < lo:
        raise ValueError(f"json_schema at {where}: minLength {lo} is more than maxLength {hi}")
    return lo, hi


def compile_schema(schema: dict) -> tuple[SchemaNode, ...]:
    """A JSON Schema (the subset OpenAI's strict structured outputs use, and what pydantic's ``model_json_schema``
    writes for models of plain fields) as schema nodes, the root last. Keywords:

    - ``type`` (a name or a list), ``enum``, ``const``;
    - ``properties``, ``required``, ``additionalProperties``: with ``properties``, only the declared keys are ever
      generated, whatever ``additionalProperties`` says (a subset of what it allows); without, any keys with
      values of the ``additionalProperties`` schema (``false``: none);
    - ``items``, ``minItems``, ``maxItems``; ``prefixItems`` (tuples) and the older ``items`` list with
      ``additionalItems``; ``uniqueItems`` over scalar items (no repeated value, no state that could only repeat
      one);
    - ``propertyNames`` as an enum / const of key names (those keys, optional, of the ``additionalProperties``
      schema);
    - ``pattern``, ``format`` (:data:`treedraft.pattern.FORMATS`; :data:`treedraft.pattern.ANY_STRING_FORMATS` take
      any string), ``minLength``, ``maxLength``, any of them together;
    - ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (numbers or draft 4's booleans),
      ``multipleOf``: such a number is written without an exponent (a subset of what they allow), and every such
      number that meets them can be;
    - ``anyOf`` / ``oneOf``: a value's first byte says its JSON type and so its branch; several branches of one type
      (anyOf; oneOf only over objects with a discriminator key) are followed side by side until the value tells
      them apart; ``allOf`` of one schema;
    - ``$ref`` to this document (``#``, ``#/$defs/Name``, any JSON pointer), recursion included;
    - annotations (title, description, default, examples, ``$defs``, ...).

    Anything else is a ValueError naming it: a constraint that cannot be enforced is refused, not silently dropped.
    The root must be an object schema, and some instance must fit in :data:`MAX_DEPTH` nested containers."""
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema: the schema must be a JSON object, got {schema!r}")
    nodes: list[SchemaNode | None] = [SchemaNode()]
    unions: dict[int, tuple[str, tuple[int, ...], str]] = {}  # node -> (where, branches, anyOf or oneOf)
    uniques: list[tuple[int, str]] = []  # uniqueItems arrays (their items are checked once every node is built)
    built: dict[int, int] = {}  # id(schema dict) -> its node (shared subschemas and recursion via $ref)

    def deref(sch: object, where: str) -> tuple[object, str]:
        """Follows ``$ref`` and one-schema ``allOf`` (their other keywords must be annotations) to the schema meant."""
        seen: set[int] = set()
        while isinstance(sch, dict) and ("$ref" in sch or "allOf" in sch):
            if id(sch) in seen:
                raise ValueError(f"json_schema at {where}: refers to itself without a value in between")
            seen.add(id(sch))
            kw = "$ref" if "$ref" in sch else "allOf"
            other = sorted(set(sch) - {kw} - _ANNOTATIONS)
            if other:
                raise ValueError(f"json_schema at {where}: {kw} beside {', '.join(map(repr, other))} is not "
                                 f"supported (only annotations may stand beside it)")  # fmt: skip
            if kw == "allOf":
                if not isinstance(sch["allOf"], list) or len(sch["allOf"]) != 1:
                    raise ValueError(f"json_schema at {where}: allOf is supported with exactly one schema")
                sch, where = sch["allOf"][0], f"{where}.allOf[0]"
            else:
                sch, where = pointer(sch["$ref"], where), sch["$ref"]
        return sch, where

    def pointer(ref: object, where: str) -> object:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"json_schema at {where}: $ref {ref!r} is not supported; only references into this "
                             f"schema ('#', '#/$defs/Name', a JSON pointer)")  # fmt: skip
        cur: object = schema
        path = urllib.parse.unquote(ref[1:])
        if path and not path.startswith("/"):
            raise ValueError(f"json_schema at {where}: $ref {ref!r}: anchors are not supported, use a JSON pointer")
        for part in path.split("/")[1:] if path else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                raise ValueError(f"json_schema at {where}: $ref {ref!r} points to nothing in the schema")
        return cur

    def add(sch: object, where: str) -> int:
        sch, where = deref(sch, where)
        if sch is True or sch == {}:
            return 0
        if sch is False:
            nodes.append(SchemaNode(types=frozenset(), need=NEVER, obj_need=NEVER, arr_need=NEVER))
            return len(nodes) - 1
        if not isinstance(sch, dict):
            raise ValueError(f"json_schema at {where}: a schema must be an object, got {sch!r}")
        if id(sch) in built:
            return built[id(sch)]
        at = built[id(sch)] = len(nodes)
        nodes.append(None)  # its slot, taken before its parts (a part may refer back to it)
        nodes[at] = build(sch, where, at)
        return at

    def named_keys(sch: dict, where: str) -> dict:
        """``propertyNames`` as an enum / const of names (pydantic's ``dict[Literal[...], X]``, enum-keyed dicts):
        the same schema with those names as optional declared keys, each of the ``additionalProperties`` schema."""
        pn, _ = deref(sch["propertyNames"], f"{where}.propertyNames")
        rest = {k: v for k, v in sch.items() if k not in ("propertyNames", "additionalProperties")}
        if pn is True or pn == {}:
            return dict(rest, additionalProperties=sch.get("additionalProperties", True))
        allowed = isinstance(pn, dict) and set(pn) - _ANNOTATIONS <= {"type", "enum", "const"}
        if not allowed or pn.get("type", "string") != "string" or not {"enum", "const"} & set(pn):  # type: ignore[union-attr]
            raise ValueError(f"json_schema at {where}: propertyNames is supported as an enum / const of key names "
                             "(e.g. a dict keyed by a Literal or an enum)")  # fmt: skip
        if "properties" in sch:
            raise ValueError(f"json_schema at {where}: propertyNames beside properties is not supported")
        names = [pn["const"]] if "const" in pn else pn["enum"]  # type: ignore[index, operator]
        if not isinstance(names, list):
            raise ValueError(f"json_schema at {where}: propertyNames.enum must be a list")
        extra = sch.get("additionalProperties", True)
        keys = [] if extra is False else [n for n in dict.fromkeys(names) if isinstance(n, str)]
        return dict(rest, properties={n: extra for n in keys}, additionalProperties=False)

    def build(sch: dict, where: str, at: int) -> SchemaNode:
        unknown = sorted(set(sch) - _KEYWORDS - _ANNOTATIONS)
        if unknown:
            raise ValueError(
                f"json_schema at {where}: keyword(s) {', '.join(map(repr, unknown))} not supported; supported: "
                f"{', '.join(sorted(_KEYWORDS))} (and annotations)"
            )
        if "propertyNames" in sch:
            sch = named_keys(sch, where)
        if "anyOf" in sch or "oneOf" in sch:
            kw = "anyOf" if "anyOf" in sch else "oneOf"
            other = sorted(set(sch) - {kw} - _ANNOTATIONS)
            if other:
                raise ValueError(f"json_schema at {where}: {kw} beside {', '.join(map(repr, other))} is not "
                                 f"supported (put those keywords in each branch)")  # fmt: skip
            branches = sch[kw]
            if not isinstance(branches, list) or not branches:
                raise ValueError(f"json_schema at {where}: {kw} must be a non-empty list of schemas")
            unions[at] = (f"{where}.{kw}", tuple(add(b, f"{where}.{kw}[{i}]") for i, b in enumerate(branches)), kw)
            return SchemaNode(types=frozenset())
        t = sch.get("type")
        if t is None:
            t = "object" if "properties" in sch else "array" if {"items", "prefixItems"} & set(sch) else list(TYPES)
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not types or any(x not in TYPES for x in types):
            raise ValueError(f"json_schema at {where}: type must be one of {', '.join(TYPES)} or a list of them")
        num = _numeric(sch, where)
        if "enum" in sch or "const" in sch:
            vals = [sch["const"]] if "const" in sch else sch["enum"]
            if not isinstance(vals, list) or not vals:
                raise ValueError(f"json_schema at {where}: enum must be a non-empty list")
            both = sorted({"pattern", "format"} & set(sch))
            if both:  # (they were ignored: an enum value breaking them was written, a review found)
                raise ValueError(f"json_schema at {where}: enum / const with {' / '.join(both)} is not supported; list "
                                 "only the values that match it")  # fmt: skip
            lo, hi = _length_bounds(sch, where)  # string lengths in code points, as JSON Schema
            vals = [v for v in vals if not isinstance(v, str) or (len(v) >= lo and (hi < 0 or len(v) <= hi))]
            texts = []
            for v in vals:
                if isinstance(v, (dict, list)):
                    raise ValueError(f"json_schema at {where}: enum / const values must be strings, numbers, "
                                     f"booleans or null, got {v!r}")  # fmt: skip
                if _conforms_type(v, types) and _within(v, num):
                    texts.append(json.dumps(v, ensure_ascii=False, allow_nan=False).encode("utf-8"))
            if not texts:
                raise ValueError(f"json_schema at {where}: no enum / const value is of type {t!r}"
                                 + (" within its bounds / multipleOf" if num else "")
                                 + (" within minLength / maxLength" if {"minLength", "maxLength"} & set(sch) else ""))  # fmt: skip
            return SchemaNode(enum=tuple(dict.fromkeys(texts)))
        props = sch.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"json_schema at {where}: properties must be an object")
        required = sch.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) or r not in props for r in required):
            raise ValueError(f"json_schema at {where}: required must list names from properties, got {required!r}")
        numeric = None
        if num and ("number" in types or "integer" in types):
            try:
                numeric = _numeric_pattern(num, integer="number" not in types)
            except ValueError as e:
                raise ValueError(f"json_schema at {where}: {e}") from None
        bounds = []
        for kw in ("minItems", "maxItems", "minProperties", "maxProperties"):
            v = sch.get(kw, -1 if kw.startswith("max") else 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < -1 or (kw in sch and v < 0):
                raise ValueError(f"json_schema at {where}: {kw} must be a non-negative integer, got {v!r}")
            bounds.append(v)
        for lo, hi, what in ((bounds[0], bounds[1], "Items"), (bounds[2], bounds[3], "Properties")):
            if 0 <= hi < lo:
                raise ValueError(f"json_schema at {where}: min{what} {lo} is more than max{what} {hi}")
        if "properties" not in sch and bounds[2] > 1:
            raise ValueError(f"json_schema at {where}: minProperties above 1 is supported only with properties (an "
                             "object without them does not track its keys, so a repeated key would count twice)")  # fmt: skip
        if 0 <= bounds[3] < len(set(required)):
            raise ValueError(f"json_schema at {where}: maxProperties {bounds[3]} is below the {len(set(required))} "
                             "required keys")  # fmt: skip
        pattern: Pattern | Length | LengthBounded | None = None
        parts: list[Pattern | Length] = []
        if {"minLength", "maxLength"} & set(sch):
            parts.append(Length(*_length_bounds(sch, where)))
        if "pattern" in sch:
            if not isinstance(sch["pattern"], str):
                raise ValueError(f"json_schema at {where}: pattern must be a string")
            try:
                parts.append(Pattern(sch["pattern"]))
            except ValueError as e:
                raise ValueError(f"json_schema at {where}: {e}") from None
        if "format" in sch and sch["format"] not in ANY_STRING_FORMATS:
            if sch["format"] not in FORMATS:
                raise ValueError(f"json_schema at {where}: format {sch['format']!r} is not supported; supported: "
                                 f"{', '.join([*FORMATS, *sorted(ANY_STRING_FORMATS)])}")  # fmt: skip
            parts.append(Pattern(FORMATS[sch["format"]], label=f"format {sch['format']}"))
        if len(parts) == 1:
            pattern = parts[0]  # a length bound alone keeps its fast masks (Length)
        elif parts:  # together: the product automaton of their DFAs (a length bound as ^[\s\S]{lo,hi}$), or
            # a long maxLength with minLength 0 or 1 counted beside the patterns' DFA (LengthBounded)
            try:
                length = parts[0] if isinstance(parts[0], Length) else None
                pats = [p for p in parts if isinstance(p, Pattern)]
                if length is not None and length.lo <= 1 and length.hi >= LONG_LENGTH:
                    pattern = LengthBounded(functools.reduce(operator.and_, pats), length.lo, length.hi)
                else:
                    pattern = functools.reduce(operator.and_, [p.as_pattern() if isinstance(p, Length) else p
                                                               for p in parts])  # fmt: skip
            except ValueError as e:
                raise ValueError(f"json_schema at {where}: {e}") from None
        names = list(props)
        values = tuple(add(props[k], f"{where}.properties.{k}") for k in names)
        prefix_given = sch.get("prefixItems", [])
        rest, rest_kw = sch.get("items", {}), "items"
        if isinstance(rest, list):  # drafts 4-2019's tuple form: items as a list, then additionalItems
            if "prefixItems" in sch:
                raise ValueError(f"json_schema at {where}: items as a list beside prefixItems; use prefixItems")
            prefix_given, rest, rest_kw = rest, sch.get("additionalItems", {}), "additionalItems"
        if not isinstance(prefix_given, list):
            raise ValueError(f"json_schema at {where}: prefixItems must be a list of schemas")
        prefix = tuple(add(x, f"{where}.prefixItems[{i}]") for i, x in enumerate(prefix_given))
        items = add(rest, f"{where}.{rest_kw}")
        extra = sch.get("additionalProperties", True)
        extra = -1 if extra is False else add(extra, f"{where}.additionalProperties")
        keys = tuple(json.dumps(k, ensure_ascii=False)[1:-1].encode("utf-8") for k in names)
        req = sum(1 << names.index(r) for r in set(required))
        node = SchemaNode(frozenset(types), keys, values, req, items, None, "properties" not in sch, extra, *bounds)
        unique = sch.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise ValueError(f"json_schema at {where}: uniqueItems must be true or false")
        if unique and prefix:
            raise ValueError(f"json_schema at {where}: uniqueItems with prefixItems is not supported")
        if unique and "array" in types:  # (on other types it constrains nothing)
            uniques.append((at, where))
        return replace(node, pattern=pattern, numeric=numeric, prefix=prefix, unique=unique)

    try:
        root = add(schema, "$")
    except RecursionError:
        raise ValueError("json_schema: nested too deeply to compile") from None
    for at, (where, _, kw) in unions.items():
        nodes[at] = replace(nodes[at], dispatch=_dispatch(nodes, unions, at, where, kw == "oneOf"))  # type: ignore[arg-type]
    for at, where in uniques:
        it = nodes[nodes[at].items]  # type: ignore[union-attr]
        scalar = it.enum is not None or not it.types & {"object", "array"} and it.types
        if it.dispatch is not None or not scalar or it.pattern is not None or it.numeric is not None:
            raise ValueError(f"json_schema at {where}: uniqueItems is supported for arrays of free strings, numbers, "
                             "booleans, null or enum values (no objects, arrays, unions, patterns or bounds in the "
                             "items)")  # fmt: skip
        values = _finite_values(it)
        if values is not None:  # finitely many distinct items
            distinct = len(values)
            if nodes[at].min_items > distinct:  # type: ignore[union-attr]
                raise ValueError(f"json_schema at {where}: minItems {nodes[at].min_items} with uniqueItems, but "  # type: ignore[union-attr]
                                 f"the items have only {distinct} distinct values")  # fmt: skip
    done = _needs(nodes)  # type: ignore[arg-type]
    top = done[root]
    if top.dispatch is not None:  # a union at the root: its object branch(es)
        objs = top.dispatch[0]
        if len(objs) == 1:
            top = done[objs[0]]
        elif objs:
            need = min(done[b].obj_need for b in objs)
            top = replace(top, dispatch=(objs,) + ((),) * (len(_CLASS_NAMES) - 1), obj_need=need)
    if (
        top.enum is not None
        or (top.dispatch is None and "object" not in top.types)
        or root == 0
        or (top.dispatch is not None and not top.dispatch[0])
    ):
        raise ValueError("json_schema: the root must be an object schema (type: object)")
    if top.obj_need > MAX_DEPTH:
        raise ValueError(f"json_schema: every instance needs more than {MAX_DEPTH} nested objects / arrays (the "
                         f"most JSON mode writes), or none is finite")  # fmt: skip
    return (*done, top)


def _classes(node: SchemaNode) -> set[int]:
    if node.enum is not None:
        return {_CLASS[e[0]] for e in node.enum}
    return {_TYPE_CLASS[t] for t in node.types}


def _dispatch(nodes: list, unions: dict, at: int, where: str, one: bool) -> tuple[tuple[int, ...], ...]:
    """A union's branches per value class, nested unions flattened. Several branches of one class are followed side
    by side (anyOf); under oneOf only object branches told apart by a discriminator (:func:`_discriminated`), so no
    value matches two. ValueError where oneOf has one schema twice (no value of it would match exactly one)."""
    table: list[list[int]] = [[] for _ in _CLASS_NAMES]
    owner: list[list[str]] = [[] for _ in _CLASS_NAMES]

    visited: set[int] = set()  # unions already flattened (shared ones would otherwise be walked once per path)

    def visit(n: int, path: str, trail: tuple[int, ...]) -> None:
        if n in unions:
            if n in trail:
                raise ValueError(f"json_schema at {where}: refers to itself without a value in between")
            if n in visited:
                if one:
                    raise ValueError(f"json_schema at {where}: {path} repeats a union already among the branches "
                                     "(the same schemas twice under oneOf: no value matches exactly one)")  # fmt: skip
                return
            visited.add(n)
            for i, b in enumerate(unions[n][1]):
                visit(b, f"{path}[{i}]" if n == at else f"{path}.{i}", (*trail, n))
            return
        for k in _classes(nodes[n]):
            if n in table[k]:
                if one:
                    raise ValueError(f"json_schema at {where}: branches {owner[k][table[k].index(n)]} and {path} both "
                                     f"take {_CLASS_NAMES[k]} (the same schema twice under oneOf: no value matches "
                                     "exactly one)")  # fmt: skip
                continue
            table[k].append(n)
            owner[k].append(path)

    visit(at, "", ())
    for k, branches in enumerate(table):
        if len(branches) > MAX_ALTERNATIVES:
            raise ValueError(f"json_schema at {where}: {len(branches)} branches take {_CLASS_NAMES[k]}; at most "
                             f"{MAX_ALTERNATIVES} can be followed side by side")  # fmt: skip
        if one and len(branches) > 1 and (k != 0 or not _discriminated(nodes, branches)):
            raise ValueError(f"json_schema at {where}: branches {' and '.join(owner[k])} of oneOf both take "
                             f"{_CLASS_NAMES[k]}; supported: branches of different JSON types, or objects with a "
                             "discriminator (a key every branch requires, with a distinct const / enum in each); "
                             "anyOf takes any")  # fmt: skip
    return tuple(tuple(b) for b in table)


def _discriminated(nodes: list, branches: list[int]) -> bool:
    """Whether the object schemas ``branches`` share a declared key that each requires with const / enum values no
    other branch allows (pydantic's discriminated unions): then no object matches two of them."""
    first = nodes[branches[0]]
    for key in first.keys:
        seen: set[tuple] = set()
        for b in branches:
            nd = nodes[b]
            if nd.free or nd.dispatch is not None or key not in nd.keys:
                break
            i = nd.keys.index(key)
            vals = nodes[nd.values[i]].enum
            keys = {_canon(v) for v in vals} if vals is not None else set()
            if not nd.required >> i & 1 or vals is None or seen & keys:
                break
            seen |= keys
        else:
            return True
    return False


def _needs(nodes: list[SchemaNode]) -> list[SchemaNode]:
    """Each node's ``need`` / ``obj_need`` / ``arr_need`` (see :class:`SchemaNode`): a fixed point from "never",
    since recursive schemas refer to themselves."""
    need = [NEVER] * len(nodes)
    obj = [NEVER] * len(nodes)
    arr = [NEVER] * len(nodes)
    changed = True
    while changed:
        changed = False
        for i, nd in enumerate(nodes):
            if nd.dispatch is not None:
                o, a = NEVER, NEVER
                n = min([need[b] for bs in nd.dispatch for b in bs], default=NEVER)
            elif nd.enum is not None:
                o, a, n = NEVER, NEVER, 0
            else:
                o = a = NEVER
                if "object" in nd.types:
                    req = [need[v] for j, v in enumerate(nd.values) if nd.required >> j & 1]
                    more = nd.min_props - len(req)  # keys past the required ones: the cheapest that many
                    if more > 0 and nd.free:
                        req += [need[nd.extra] if nd.extra >= 0 else NEVER]
                    elif more > 0:
                        opt = sorted(need[v] for j, v in enumerate(nd.values) if not nd.required >> j & 1)
                        req += opt[more - 1 : more] if len(opt) >= more else [NEVER]
                    o = min(NEVER, 1 + max(req, default=0))
                if "array" in nd.types:  # the items minItems asks for: prefixItems' first, then items
                    firsts = [need[_item_node(nd, i)] for i in range(min(nd.min_items, len(nd.prefix) + 1))]
                    a = min(NEVER, 1 + max(firsts, default=0))
                n = min(o, a, 0 if any(t in nd.types for t in _SCALARS) else NEVER)
            if (n, o, a) != (need[i], obj[i], arr[i]):
                need[i], obj[i], arr[i] = n, o, a
                changed = True
    return [replace(nd, need=need[i], obj_need=obj[i], arr_need=arr[i]) for i, nd in enumerate(nodes)]


class _Node:
    __slots__ = ("kids", "ids")

    def __init__(self) -> None:
        self.kids: dict[int, _Node] = {}
        self.ids: list[int] = []


def byte_trie(token_bytes: Sequence[bytes | None]) -> _Node:
    """The vocabulary as a trie over bytes: a node's ``kids`` by next byte, ``ids`` the tokens ending there (tokens
    whose bytes are None are left out). JSON mode and regex answers walk it with their automata."""
    root = _Node()
    for t, b in enumerate(token_bytes):
        if b is not None:
            node = root
            for c in b:
                nxt = node.kids.get(c)
                if nxt is None:
                    nxt = node.kids[c] = _Node()
                node = nxt
            node.ids.append(t)
    return root


class _ClassNode:
    """A node of a pattern's class trie: the in-string tokens as sequences of the pattern's character classes
    (``kids`` by class), those ending here (``ids``) and those ending here inside an unfinished character
    (``tails``: (UTF-8 state, its bits so far) -> their ids)."""

    __slots__ = ("kids", "ids", "tails")

    def __init__(self) -> None:
        self.kids: dict[int, _ClassNode] = {}
        self.ids: np.ndarray | list[int] = []
        self.tails: dict[tuple[int, int], np.ndarray] = {}


class JsonGrammar:
    """The JSON automaton over one vocabulary: ``token_bytes[t]`` is token t's bytes (None: never allowed, e.g.
    control tokens); ``eos_ids`` end the answer once the object is closed (and only then); ``vocab_size``: the
    model's logit rows (ids past ``token_bytes`` are never allowed). Any JSON object; :meth:`with_schema` gives the
    automaton of a JSON Schema over the same vocabulary index. Shared by requests (it keeps masks per state)."""

    nodes: tuple[SchemaNode, ...] = ANY

    def __init__(self, token_bytes: Sequence[bytes | None], eos_ids: Sequence[int], vocab_size: int | None = None):
        self.vocab_size = len(token_bytes) if vocab_size is None else int(vocab_size)
        self.eos = tuple(sorted({int(t) for t in eos_ids}))
        if not self.eos:
            raise ValueError("JSON mode needs the model's EOS token ids (the answer ends with one)")
        if any(not 0 <= t < self.vocab_size for t in self.eos):
            raise ValueError(f"EOS ids {list(self.eos)} outside the vocabulary (0..{self.vocab_size - 1})")
        self.bytes: list[bytes | None] = [None] * self.vocab_size
        for t, b in enumerate(token_bytes[: self.vocab_size]):
            if b and t not in self.eos:
                self.bytes[t] = bytes(b)
        self.root = byte_trie(self.bytes)
        # tokens with a quote or a backslash: the only ones that can leave a string or start an escape
        self._exits = [t for t, b in enumerate(self.bytes) if b is not None and (b'"' in b or b"\\" in b)]
        self._in_string: dict[int, np.ndarray] = {}  # UTF-8 state -> tokens that stay inside a string
        self._in_string_n: dict[int, np.ndarray] = {}  # UTF-8 state -> characters each of those takes
        self._masks: OrderedDict[State, np.ndarray] = OrderedDict()
        self._shared: dict = {}  # the vocabulary's tables every schema's automaton shares (_string_chars)
        self._class_tries: dict[int, tuple] = {}  # id(pattern) -> its class trie (per schema)
        self._max_masks = max(16, (32 << 20) // max(1, self.vocab_size))
        eos_only = np.zeros(self.vocab_size, np.bool_)
        eos_only[list(self.eos)] = True
        eos_only.setflags(write=False)
        self._eos_only = eos_only

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> JsonGrammar:
        """The grammar over a :class:`treedraft.tokenizer.Tokenizer`'s vocabulary; its special tokens are never
        part of the JSON text."""
        n = tokenizer.vocab_size
        return cls(
            token_bytes_of(tokenizer), sorted(tokenizer.eos_token_ids), vocab_size if vocab_size is not None else n
        )

    def with_schema(self, schema: dict) -> JsonGrammar:
        """The automaton of objects valid under ``schema`` (:func:`compile_schema`; ValueError for what it does not
        support), sharing this one's vocabulary index (the trie, the in-string tables)."""
        g = copy.copy(self)
        g.nodes = compile_schema(schema)
        g._masks = OrderedDict()
        g._class_tries = {}
        return g

    def start(self) -> State:
        """The state before the answer's first token."""
        return (START, 0, len(self.nodes) - 1, ())  # the root is the last node (ANY's only one)

    def advance(self, s: State | None, token: int) -> State | None:
        """The state after ``token`` (None: the automaton refuses it there)."""
        if s is None:
            return None
        if token in self.eos:
            return (END, 0, 0, ()) if s[0] >= DONE else None
        b = self.bytes[token] if 0 <= token < self.vocab_size else None
        return None if b is None else run(s, b, self.nodes)

    def allows(self, s: State, token: int) -> bool:
        return self.advance(s, token) is not None

    def allowed(self, s: State) -> np.ndarray:
        """(vocab_size,) bool: the tokens that can follow state ``s`` (read-only; kept per state)."""
        m = self._masks.get(s)
        if m is not None:
            self._masks.move_to_end(s)
            return m
        if s[0] >= DONE:
            return self._eos_only
        if s[0] == STR or s[0] == PSTR and isinstance(self.nodes[s[2][0]].pattern, Length):
            if s[0] == STR:
                m = self._in_string_mask(s[2]).copy()
            else:  # a length-bounded string: the in-string tokens whose characters fit
                room = self.nodes[s[2][0]].pattern.room(s[1])  # type: ignore[union-attr]
                need = self._in_string_chars(s[2][1])
                m = need >= 0 if room < 0 else (need >= 0) & (need <= room)
            m[[t for t in self._exits if run(s, self.bytes[t], self.nodes) is not None]] = True
        elif s[0] == PSTR and s[2][1] == 0:  # a patterned string at a character boundary: the class trie
            m = self._patterned_mask(self.nodes[s[2][0]].pattern, s[1])  # type: ignore[arg-type]
            m[[t for t in self._exits if run(s, self.bytes[t], self.nodes) is not None]] = True
        elif s[0] == MULTI:
            # branches side by side: a token is allowed where one of them takes it whole (each follows its own
            # bytes; merging only drops repeats), so the union of their masks, each by its own fast path (a free
            # string inside a union of two objects: its first mask took 301 ms as one walk of the byte trie, 1.2 ms
            # so; benchmarks/grammar_mask_cost.py). A finished branch takes no byte, and EOS only once the union is
            # resolved
            m = np.zeros(self.vocab_size, np.bool_)
            for x in s[1]:
                if x[0] < DONE:
                    m |= self.allowed(x)
        else:
            m = np.zeros(self.vocab_size, np.bool_)
            ids: list[int] = []
            self._walk(self.root, s, ids)
            m[ids] = True
        if not m.any():  # cannot happen with a vocabulary holding every single byte
            raise GenerationError("no token of this vocabulary continues the JSON text")
        m.setflags(write=False)
        self._masks[s] = m
        if len(self._masks) > self._max_masks:
            self._masks.popitem(last=False)
        return m

    def _walk(self, node: _Node, s: State, out: list[int]) -> None:
        for c, kid in node.kids.items():
            ns = step(s, c, self.nodes)
            if ns is not None:
                out.extend(kid.ids)
                if kid.kids:
                    self._walk(kid, ns, out)

    def _string_chars(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The tokens that stay inside a string from a character boundary, as (their ids; the code points of the
        characters they complete, all in a row; where each token's start there (one more: the end); each one's
        unfinished last character as UTF-8 state << 32 | its bits so far, 0 for none). Once per vocabulary."""
        got = self._shared.get("chars")
        if got is None:
            ids = np.flatnonzero(self._in_string_mask(0))
            flat: list[int] = []
            starts, tails = [0], []
            for t in ids.tolist():
                u = cp = 0
                for c in self.bytes[t]:  # well-formed (the mask says so)
                    if u:
                        cp, u = cp << 6 | c & 0x3F, _UTF8_NEXT[u]
                        if not u:
                            flat.append(cp)
                    elif c < 0x80:
                        flat.append(c)
                    else:
                        u = _UTF8_LEAD[c]
                        cp = c & _UTF8_BITS[u]
                starts.append(len(flat))
                tails.append(u << 32 | cp if u else 0)
            got = (ids, np.array(flat, np.int64), np.array(starts, np.int64), np.array(tails, np.int64))
            self._shared["chars"] = got
        return got

    def _class_trie(self, p: Pattern) -> tuple[list[list[int]], _ClassNode]:
        """The in-string tokens as a trie over ``p``'s character classes (:meth:`Pattern.classes`): tokens whose
        characters fall in the same classes share a path, so a mask walks a few hundred nodes, not the vocabulary's
        byte trie. Built a character position at a time over all tokens at once (a node per distinct (parent,
        class)). Returns (per DFA state, the next state by class; the root)."""
        got = self._class_tries.get(id(p))
        if got is None:
            ids, flat, starts, tails = self._string_chars()
            cuts, of, table = p.classes()
            width = len(table[0])
            cls = np.asarray(of, np.int64)[np.searchsorted(np.asarray(cuts, np.int64), flat, side="right") - 1]
            lengths = np.diff(starts)
            at = np.zeros(len(ids), np.int64)  # each token's node so far (0: the root)
            nodes = [_ClassNode()]
            active, j = np.arange(len(ids)), 0
            while True:
                active = active[lengths[active] > j]
                if not len(active):
                    break
                key = at[active] * width + cls[starts[active] + j]  # (parent node, class): dense, so no sort
                seen = np.zeros(len(nodes) * width, np.bool_)
                seen[key] = True
                new = np.flatnonzero(seen)
                rank = np.cumsum(seen) - 1
                for k in new.tolist():
                    node = _ClassNode()
                    nodes[k // width].kids[k % width] = node
                    nodes.append(node)
                at[active] = len(nodes) - len(new) + rank[key]
                j += 1
            order = np.lexsort((tails, at))  # tokens grouped by (node, unfinished character)
            bounds = np.flatnonzero(np.diff(at[order]) | np.diff(tails[order])) + 1
            for group in np.split(order, bounds):
                node, tail = nodes[int(at[group[0]])], int(tails[group[0]])
                if tail:
                    node.tails[(tail >> 32, tail & 0xFFFFFFFF)] = ids[group]
                else:
                    node.ids = ids[group]
            got = self._class_tries[id(p)] = (table, nodes[0])
        return got

    def _patterned_mask(self, p: Pattern, d: int) -> np.ndarray:
        """The in-string tokens that keep a string under ``p`` alive from DFA state ``d`` (at a character boundary):
        each complete character a step of the DFA, an unfinished last one live where some character it can still
        become is (as :func:`_patterned` checks it byte by byte)."""
        table, root = self._class_trie(p)
        out: list[np.ndarray] = []

        def walk(node: _ClassNode, d: int) -> None:
            for tail, toks in node.tails.items():
                if _utf8_live(p, d, *tail):
                    out.append(toks)
            for k, kid in node.kids.items():
                d2 = table[d][k]
                if d2 >= 0:
                    if len(kid.ids):
                        out.append(kid.ids)  # type: ignore[arg-type]
                    walk(kid, d2)

        walk(root, d)
        m = np.zeros(self.vocab_size, np.bool_)
        if out:
            m[np.concatenate(out)] = True
        return m

    def _in_string_chars(self, utf8: int) -> np.ndarray:
        """Per token, the characters it takes room for inside a string from UTF-8 state ``utf8``: those it completes,
        plus one it leaves unfinished (-1: it cannot stay in the string)."""
        v = self._in_string_n.get(utf8)
        if v is None:
            v = np.full(self.vocab_size, -1, np.int32)
            stay = self._in_string_mask(utf8)
            for t in np.flatnonzero(stay):
                b = self.bytes[t]
                done, u = 0, utf8
                for c in b:  # well-formed (the mask says so): count the characters that end here
                    u = _UTF8_NEXT[u] if u else (_UTF8_LEAD[c] if c >= 0x80 else 0)
                    done += u == 0
                v[t] = done + (u != 0)
            self._in_string_n[utf8] = v
        return v

    def _in_string_mask(self, utf8: int) -> np.ndarray:
        """Tokens that stay inside a string (no quote, backslash or control byte; well-formed UTF-8 from ``utf8``)."""
        m = self._in_string.get(utf8)
        if m is None:
            m = np.zeros(self.vocab_size, np.bool_)
            s0 = (STR, 0, utf8, (("{", 0, 0, -1),))
            for t, b in enumerate(self.bytes):
                if b is not None and b'"' not in b and b"\\" not in b:
                    s = run(s0, b)
                    m[t] = s is not None
            self._in_string[utf8] = m
        return m


def token_bytes_of(tokenizer) -> list[bytes | None]:
    """Each token's bytes (None for special tokens, never part of an answer's text), from the tokenizer's own
    ``token_bytes`` or, for a test tokenizer without it, each token's text."""
    special = getattr(tokenizer, "special_ids", frozenset())
    own = getattr(tokenizer, "token_bytes", None)
    of = own if callable(own) else lambda t: tokenizer.decode([t]).encode("utf-8")
    return [None if t in special else of(t) for t in range(tokenizer.vocab_size)]


def prune(grammar: JsonGrammar, tree: TokenTree, state: State) -> tuple[TokenTree, list[State]]:
    """Drop the tree's nodes whose token the automaton refuses after their path (and their subtrees): the
    constrained target never accepts them. Returns the tree and each kept node's row state (the state after the
    committed tokens and the node's path; ``state`` is the root's). A parent whose sampled children lose one keeps
    the rest as fixed candidates (its ``child_q`` is dropped: the lossless rule is exact for any candidates drawn
    independently of the target's draws, and q no longer describes how they were drawn)."""
    states: list[State | None] = [state]
    for i in range(1, len(tree)):
        ps = states[tree.parents[i]]
        try:
            states.append(None if ps is None else grammar.advance(ps, tree.tokens[i]))
        except GenerationError:  # (too many union branches alive after it): a draft never raises; plain decoding
            states.append(None)  # fails exactly where it takes this token, and so does the target's own choice
    keep = [i for i, s in enumerate(states) if s is not None]
    if len(keep) == len(tree):
        return tree, states  # type: ignore[return-value]
    gone = {tree.parents[i] for i, s in enumerate(states) if s is None}
    kept = tree.kept(keep, drop_q=gone)
    return kept, [states[i] for i in keep]  # type: ignore[misc]


def _noop() -> None:
    return None


def constrain_(logits: Tensor, grammar: JsonGrammar, states: Sequence[State], greedy: bool) -> Callable[[], None]:
    """Constrain rows (N, V) in place: row r to the tokens allowed after ``states[r]`` (-inf elsewhere). With
    ``greedy``, a row whose argmax is allowed is left as it is (its masked argmax is the same token). Returns a
    function that puts the model's values back."""
    from .verify import greedy_token

    kept: list[tuple[int, Tensor]] = []

    def undo() -> None:
        for r, v in kept:
            logits[r] = v

    try:
        for r, s in enumerate(states):
            row = logits[r]
            if greedy and grammar.allows(s, greedy_token(row)):
                continue
            ok = grammar.allowed(s)
            kept.append((r, row.clone()))
            if row.device.type == "cpu" and row.dtype == torch.float32:
                np.copyto(row.detach().numpy(), np.float32("-inf"), where=~ok)
            else:
                row.masked_fill_(~torch.from_numpy(ok.copy()).to(row.device), float("-inf"))
    except BaseException:
        undo()  # no row left half constrained
        raise
    return undo if kept else _noop
