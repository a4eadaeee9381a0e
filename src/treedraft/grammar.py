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
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .interfaces import GenerationError
from .tree import TokenTree

MAX_DEPTH = 32  # nested objects / arrays
MAX_WS = 32  # whitespace bytes in a row between tokens of the JSON text

# modes. A state is (mode, a, b, stack); stack: a tuple of the open containers' frames, ("{", schema node, keys seen
# (bitmask), the key being written or -1) for objects and ("[", schema node) for arrays
START, VALUE, ARR_FIRST, OBJ_FIRST, KEY, COLON, AFTER, STR, ESC, UHEX, NUM, LIT, KSTR, ENUM, DONE, END = range(16)
# structural modes: a = the whitespace bytes just read (START: b = the root's schema node)
# STR: a = 1 in a free object's key, 0 in a value; b = the UTF-8 state below.  ESC: a as STR.  UHEX: a as STR, b =
# hex digits left.  NUM: a = the number state below, b = 1 for integers only.  LIT: a = the literal's bytes still to
# come.  KSTR: a declared key being written, a = its bytes so far.  ENUM: a = the value's bytes so far, b = its node.
# DONE: the object is closed (EOS only); END: after that EOS (EOS only: drafts beyond it are never delivered)

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
_HEX = frozenset(b"0123456789abcdefABCDEF")
_WS = frozenset(b" \t\n\r")
_ESCAPED = frozenset(b'"\\/bfnrt')

State = tuple
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


@dataclass(frozen=True)
class SchemaNode:
    """One schema of a compiled JSON Schema (:func:`compile_schema`). ``keys``: the declared properties' names as
    their JSON text (escaped UTF-8, no quotes), the only keys its objects take unless ``free`` (no ``properties``:
    any keys, each value node 0, any JSON). ``required``: bitmask over ``keys``. ``enum``: the allowed values'
    compact JSON texts (None: any of ``types``)."""

    types: frozenset[str] = frozenset(TYPES)
    keys: tuple[bytes, ...] = ()
    values: tuple[int, ...] = ()
    required: int = 0
    items: int = 0
    enum: tuple[bytes, ...] | None = None
    free: bool = True


ANY = (SchemaNode(),)  # json_object: node 0 is any JSON value (an object at the top)


def _close(stack: tuple) -> State:
    rest = stack[:-1]
    return (AFTER, 0, 0, rest) if rest else (DONE, 0, 0, ())


def _value_node(stack: tuple, nodes: Sequence[SchemaNode]) -> int:
    """The schema node of the value that starts here (in the innermost container)."""
    top = stack[-1]
    if top[0] == "[":
        return nodes[top[1]].items
    node = nodes[top[1]]
    return 0 if node.free else node.values[top[3]]


def _value(c: int, stack: tuple, n: int, nodes: Sequence[SchemaNode]) -> State | None:
    """The state after byte ``c`` where a value of schema node ``n`` starts."""
    node = nodes[n]
    if node.enum is not None:
        p = bytes([c])
        return (ENUM, p, n, stack) if any(e.startswith(p) for e in node.enum) else None
    t = node.types
    if c == 0x22:  # "
        return (STR, 0, 0, stack) if "string" in t else None
    if c in _DIGITS or c == 0x2D:  # a digit, -
        if "number" not in t and "integer" not in t:
            return None
        sub = N_MINUS if c == 0x2D else N_ZERO if c == 0x30 else N_INT
        return (NUM, sub, int("number" not in t), stack)
    if c == 0x7B or c == 0x5B:  # { [
        if len(stack) >= MAX_DEPTH or ("object" if c == 0x7B else "array") not in t:
            return None
        return (OBJ_FIRST, 0, 0, (*stack, ("{", n, 0, -1))) if c == 0x7B else (ARR_FIRST, 0, 0, (*stack, ("[", n)))
    if (c == 0x74 or c == 0x66) and "boolean" in t:  # t f
        return (LIT, b"rue" if c == 0x74 else b"alse", 0, stack)
    if c == 0x6E and "null" in t:  # n
        return (LIT, b"ull", 0, stack)
    return None


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


def _declared_key(s: State, c: int, nodes: Sequence[SchemaNode]) -> State | None:
    prefix, stack = s[1], s[3]
    _, n, seen, _ = frame = stack[-1]
    keys = nodes[n].keys
    if c == 0x22 and (len(prefix) - len(prefix.rstrip(b"\\"))) % 2 == 0:  # the key ends (no escaped quote)
        for i, k in enumerate(keys):
            if k == prefix and not seen >> i & 1:
                return (COLON, 0, 0, (*stack[:-1], (frame[0], n, seen | 1 << i, i)))
        return None
    p = prefix + bytes([c])
    ok = any(k.startswith(p) and not seen >> i & 1 for i, k in enumerate(keys))
    return (KSTR, p, 0, stack) if ok else None


def _closes(frame: tuple, nodes: Sequence[SchemaNode]) -> bool:
    """An object may close here: every required key written."""
    req = nodes[frame[1]].required
    return frame[2] & req == req


def _more_keys(frame: tuple, nodes: Sequence[SchemaNode]) -> bool:
    """An object may take another key: a free one, or a declared key not written yet."""
    node = nodes[frame[1]]
    return node.free or frame[2] != (1 << len(node.keys)) - 1


def step(s: State, c: int, nodes: Sequence[SchemaNode] = ANY) -> State | None:
    """The automaton's state after byte ``c`` (0..255), or None where no JSON object (of ``nodes``' schema)
    continues so."""
    mode = s[0]
    if mode == STR:
        b = s[2]
        if b == 0:
            if c == 0x22:  # the string ends: a key wants its colon, a value what follows values
                return (COLON, 0, 0, s[3]) if s[1] else (AFTER, 0, 0, s[3])
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
    if mode == KSTR:
        return _declared_key(s, c, nodes)
    if mode == ENUM:
        p = s[1] + bytes([c])
        enum = nodes[s[2]].enum
        if any(e.startswith(p) for e in enum):
            return (ENUM, p, s[2], s[3])
        return step((AFTER, 0, 0, s[3]), c, nodes) if s[1] in enum else None
    if mode == ESC:
        if c in _ESCAPED:
            return (STR, s[1], 0, s[3])
        return (UHEX, s[1], 4, s[3]) if c == 0x75 else None  # u
    if mode == UHEX:
        if c not in _HEX:
            return None
        return (STR, s[1], 0, s[3]) if s[2] == 1 else (UHEX, s[1], s[2] - 1, s[3])
    if mode == LIT:
        rest = s[1]
        if c != rest[0]:
            return None
        return (LIT, rest[1:], 0, s[3]) if len(rest) > 1 else (AFTER, 0, 0, s[3])
    if mode >= DONE:
        return None
    stack = s[3]
    if c in _WS:
        return None if s[1] >= MAX_WS else (mode, s[1] + 1, s[2], stack)
    if mode == AFTER:
        top = stack[-1]
        if top[0] == "[":
            return (VALUE, 0, 0, stack) if c == 0x2C else _close(stack) if c == 0x5D else None
        if c == 0x2C:  # ,
            return (KEY, 0, 0, stack) if _more_keys(top, nodes) else None
        return _close(stack) if c == 0x7D and _closes(top, nodes) else None
    if mode == VALUE:
        return _value(c, stack, _value_node(stack, nodes), nodes)
    if mode == COLON:
        return (VALUE, 0, 0, stack) if c == 0x3A else None
    if mode == KEY:
        return _key(stack, nodes) if c == 0x22 else None
    if mode == OBJ_FIRST:
        if c == 0x22:
            return _key(stack, nodes) if _more_keys(stack[-1], nodes) else None
        return _close(stack) if c == 0x7D and _closes(stack[-1], nodes) else None
    if mode == ARR_FIRST:
        return _close(stack) if c == 0x5D else _value(c, stack, _value_node(stack, nodes), nodes)
    # START: whitespace, then the object
    return (OBJ_FIRST, 0, 0, (("{", s[2], 0, -1),)) if c == 0x7B else None


def run(s: State | None, data: bytes, nodes: Sequence[SchemaNode] = ANY) -> State | None:
    """``step`` over every byte of ``data`` (None once refused)."""
    for c in data:
        if s is None:
            return None
        s = step(s, c, nodes)
    return s


_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$schema", "$id", "$comment"))
_KEYWORDS = frozenset(("type", "properties", "required", "additionalProperties", "items", "enum", "const"))


def compile_schema(schema: dict) -> tuple[SchemaNode, ...]:
    """A JSON Schema (the subset OpenAI's strict structured outputs use, without references) as schema nodes, the
    root last. Keywords: ``type`` (a name or a list), ``properties``, ``required``, ``additionalProperties`` (only
    the declared properties are ever generated, whatever it says: a subset of what it allows), ``items``,
    ``enum``, ``const``, and annotations (title, description, default, examples). Anything else is a ValueError
    naming it: a constraint that cannot be enforced is refused, not silently dropped. The root must be an object."""
    nodes: list[SchemaNode] = [SchemaNode()]

    def add(sch: object, where: str, depth: int = 1) -> int:
        if sch is True or sch == {}:
            return 0
        if not isinstance(sch, dict):
            raise ValueError(f"json_schema at {where}: a schema must be an object, got {sch!r}")
        unknown = sorted(set(sch) - _KEYWORDS - _ANNOTATIONS)
        if unknown:
            raise ValueError(
                f"json_schema at {where}: keyword(s) {', '.join(map(repr, unknown))} not supported; supported: "
                f"{', '.join(sorted(_KEYWORDS))} (and annotations)"
            )
        if "enum" in sch or "const" in sch:
            vals = [sch["const"]] if "const" in sch else sch["enum"]
            if not isinstance(vals, list) or not vals:
                raise ValueError(f"json_schema at {where}: enum must be a non-empty list")
            texts = []
            for v in vals:
                if isinstance(v, (dict, list)):
                    raise ValueError(f"json_schema at {where}: enum / const values must be strings, numbers, "
                                     f"booleans or null, got {v!r}")  # fmt: skip
                texts.append(json.dumps(v, ensure_ascii=False, allow_nan=False).encode("utf-8"))
            nodes.append(SchemaNode(enum=tuple(dict.fromkeys(texts))))
            return len(nodes) - 1
        t = sch.get("type")
        if t is None:
            t = "object" if "properties" in sch else "array" if "items" in sch else list(TYPES)
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not types or any(x not in TYPES for x in types):
            raise ValueError(f"json_schema at {where}: type must be one of {', '.join(TYPES)} or a list of them")
        if depth > MAX_DEPTH and set(types) <= {"object", "array"}:  # a container past the automaton's cap
            raise ValueError(f"json_schema at {where}: needs more than {MAX_DEPTH} nested objects / arrays")
        props = sch.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"json_schema at {where}: properties must be an object")
        required = sch.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise ValueError(f"json_schema at {where}: required must list names from properties, got {required!r}")
        names = list(props)
        values = tuple(add(props[k], f"{where}.properties.{k}", depth + 1) for k in names)
        items = add(sch.get("items", {}), f"{where}.items", depth + 1)
        keys = tuple(json.dumps(k, ensure_ascii=False)[1:-1].encode("utf-8") for k in names)
        req = sum(1 << names.index(r) for r in set(required))
        nodes.append(SchemaNode(frozenset(types), keys, values, req, items, None, "properties" not in sch))
        return len(nodes) - 1

    if not isinstance(schema, dict):
        raise ValueError(f"json_schema: the schema must be a JSON object, got {schema!r}")
    root = add(schema, "$")
    if root == 0 or "object" not in nodes[root].types or nodes[root].enum is not None:
        raise ValueError("json_schema: the root must be an object schema (type: object)")
    return tuple(nodes)


class _Node:
    __slots__ = ("kids", "ids")

    def __init__(self) -> None:
        self.kids: dict[int, _Node] = {}
        self.ids: list[int] = []


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
        self.root = _Node()
        for t, b in enumerate(self.bytes):
            if b is not None:
                node = self.root
                for c in b:
                    nxt = node.kids.get(c)
                    if nxt is None:
                        nxt = node.kids[c] = _Node()
                    node = nxt
                node.ids.append(t)
        # tokens with a quote or a backslash: the only ones that can leave a string or start an escape
        self._exits = [t for t, b in enumerate(self.bytes) if b is not None and (b'"' in b or b"\\" in b)]
        self._in_string: dict[int, np.ndarray] = {}  # UTF-8 state -> tokens that stay inside a string
        self._masks: OrderedDict[State, np.ndarray] = OrderedDict()
        self._max_masks = max(16, (32 << 20) // max(1, self.vocab_size))
        eos_only = np.zeros(self.vocab_size, np.bool_)
        eos_only[list(self.eos)] = True
        eos_only.setflags(write=False)
        self._eos_only = eos_only

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> JsonGrammar:
        """The grammar over a :class:`treedraft.tokenizer.Tokenizer`'s vocabulary; its special tokens are never
        part of the JSON text."""
        special = getattr(tokenizer, "special_ids", frozenset())
        n = tokenizer.vocab_size
        own = getattr(tokenizer, "token_bytes", None)  # else each token's text (a test tokenizer's)
        of = own if callable(own) else lambda t: tokenizer.decode([t]).encode("utf-8")
        token_bytes = [None if t in special else of(t) for t in range(n)]
        return cls(token_bytes, sorted(tokenizer.eos_token_ids), vocab_size if vocab_size is not None else n)

    def with_schema(self, schema: dict) -> JsonGrammar:
        """The automaton of objects valid under ``schema`` (:func:`compile_schema`; ValueError for what it does not
        support), sharing this one's vocabulary index (the trie, the in-string tables)."""
        g = copy.copy(self)
        g.nodes = compile_schema(schema)
        g._masks = OrderedDict()
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
        if s[0] == STR:
            m = self._in_string_mask(s[2]).copy()
            m[[t for t in self._exits if run(s, self.bytes[t], self.nodes) is not None]] = True
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


def prune(grammar: JsonGrammar, tree: TokenTree, state: State) -> tuple[TokenTree, list[State]]:
    """Drop the tree's nodes whose token the automaton refuses after their path (and their subtrees): the
    constrained target never accepts them. Returns the tree and each kept node's row state (the state after the
    committed tokens and the node's path; ``state`` is the root's). A parent whose sampled children lose one keeps
    the rest as fixed candidates (its ``child_q`` is dropped: the lossless rule is exact for any candidates drawn
    independently of the target's draws, and q no longer describes how they were drawn)."""
    states: list[State | None] = [state]
    for i in range(1, len(tree)):
        ps = states[tree.parents[i]]
        states.append(None if ps is None else grammar.advance(ps, tree.tokens[i]))
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
