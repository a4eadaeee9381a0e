"""JSON mode: the byte automaton against Python's json module and UTF-8 codec, the token masks against a
token-by-token scan, pruning of refused drafts, the per-row constraint and its undo, constrained plain decoding
against a step-by-step reference, speculative output = plain (greedy and seeded), the sampled distribution, and
the real model's answers."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction

import pytest
import torch
from spec_stats import assert_fits
from test_engine import DraftFromQ, Exact, RandomTreeDrafter, random_trees_equal_plain, tiny

import treedraft.verify
from treedraft.engine import Engine, GenerationConfig, GenerationError
from treedraft.grammar import DONE, MAX_DEPTH, MAX_WS, MULTI, PSTR, JsonGrammar, constrain_, prune, run
from treedraft.penalties import Penalties
from treedraft.sampling import SamplingParams
from treedraft.tree import TokenTree

WS = " \t\n\r"


def reference_valid(data: bytes) -> bool:
    """One JSON object as the automaton defines it, from Python's own codec and parser: strict UTF-8, an object at
    the top level, no NaN / Infinity, nothing after it, whitespace runs and nesting within the automaton's caps."""
    try:
        text = data.decode("utf-8")
        obj = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (UnicodeDecodeError, ValueError):
        return False
    if not isinstance(obj, dict) or text != text.rstrip(WS):
        return False
    try:  # no lone surrogate (\\ud800 alone): no Unicode text
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    run_ws = depth = best = 0
    in_str = esc = False
    for ch in text:  # the caps: whitespace runs and nesting outside strings
        if in_str:
            in_str, esc = (True, False) if esc else (ch != '"', ch == "\\")
            continue
        run_ws = run_ws + 1 if ch in WS else 0
        best = max(best, run_ws)
        depth += (ch in "{[") - (ch in "}]")
        if depth > MAX_DEPTH:
            return False
        in_str = ch == '"'
    return best <= MAX_WS


def random_value(rng: random.Random, depth: int = 0):
    k = rng.randrange(8 if depth < 3 else 5)
    if k == 0:
        return rng.choice([True, False, None])
    if k == 1:
        return rng.randint(-(10**6), 10**6)
    if k == 2:
        return rng.choice([0.5, -1.25e-7, 3.0e21, 0.0, 1e100])
    if k in (3, 4):
        return "".join(rng.choice('ab "\\/\n\t\u00e9\u4e2d\U0001f600\x01') for _ in range(rng.randint(0, 6)))
    if k == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_value(rng, 9) if rng.random() < 0.3 else "k": random_value(rng, depth + 1) for _ in range(3)}


def random_doc(rng: random.Random) -> bytes:
    obj = {f"k{i}": random_value(rng) for i in range(rng.randint(0, 4))}
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]))
    if rng.random() < 0.5:
        text = rng.choice(["", " ", "\n\t "]) + text
    return text.encode("utf-8")


def test_automaton_accepts_exactly_the_json_objects() -> None:
    """Valid documents (and every prefix of them) are alive, whole ones end closed; byte mutations of them are
    accepted exactly when Python's parser and codec accept them."""
    rng = random.Random(0)
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    mutated_ok = mutated_bad = 0
    for _ in range(300):
        doc = random_doc(rng)
        assert reference_valid(doc), doc
        s = g.start()
        for i, c in enumerate(doc):
            s = run(s, bytes([c]))
            assert s is not None, (doc, i)
            assert (s[0] == DONE) == (i == len(doc) - 1), (doc, i)
        for _ in range(8):
            b = bytearray(doc)
            i = rng.randrange(len(b) + 1)
            op = rng.randrange(3)
            c = rng.choice(b'{}[]":,0123456789.-+eEtrufalsn \n\\u\x80\xc3\xa9\xe4\xed\xf0\xff')
            if op == 0:
                b.insert(i, c)
            elif i < len(b):
                if op == 1:
                    del b[i]
                else:
                    b[i] = c
            ok = reference_valid(bytes(b))
            end = run(g.start(), bytes(b))
            assert (end is not None and end[0] == DONE) == ok, bytes(b)
            mutated_ok += ok
            mutated_bad += not ok
    assert mutated_ok > 100 and mutated_bad > 500  # both sides were exercised


@pytest.mark.parametrize(
    "text,ok",
    [
        (b'{"a": "\xed\x9f\xbf"}', True),  # U+D7FF
        (b'{"a": "\xed\xa0\x80"}', False),  # a surrogate
        (b'{"a": "\xc0\xaf"}', False),  # overlong
        (b'{"a": "\xf4\x8f\xbf\xbf"}', True),  # U+10FFFF
        (b'{"a": "\xf4\x90\x80\x80"}', False),  # past U+10FFFF
        (b'{"a": 01}', False),
        (b'{"a": -0.5E+3}', True),
        (b"{" + b" " * MAX_WS + b"}", True),
        (b"{" + b" " * (MAX_WS + 1) + b"}", False),
        (b'{"a":' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}", True),
        (b'{"a":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", False),
        (b"[1]", False),
        (b"{} ", False),
        (b'{"a": "\\ud83d\\ude00"}', True),  # a surrogate pair
        (b'{"a": "\\ud83d"}', False),  # a high surrogate alone
        (b'{"a": "\\ude00x"}', False),  # a low one alone
        (b'{"a": "\\ud83d\\u0041"}', False),  # a high one, then no low one
        (b'{"\\udbff\\udfff": 1}', True),  # U+10FFFF, in a key
    ],
)
def test_automaton_edge_cases(text: bytes, ok: bool) -> None:
    end = run((0, 0, 0, ()), text)
    assert (end is not None and end[0] == DONE) == ok
    assert reference_valid(text) == ok


def synthetic_vocab(rng: random.Random, n: int) -> list[bytes | None]:
    """Every single byte, then random tokens over JSON's bytes, letters, and whole / partial UTF-8 characters."""
    alphabet = [*b'{}[]":,0123456789.-+eE \n\t\\/u', *b"truefalsnxyz"]
    pieces = [bytes([c]) for c in alphabet] + [
        "é".encode(),
        "中".encode(),
        "😀".encode(),
        b"\xe4",
        b"\xb8\xad",
        b"\x80",
    ]
    vocab: list[bytes | None] = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    while len(vocab) < n:
        tok = b"".join(rng.choice(pieces) for _ in range(rng.randint(2, 6)))
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)
    vocab[5] = None  # a control token: never allowed
    return vocab


def states_along(g: JsonGrammar, rng: random.Random, docs: int) -> list[tuple]:
    out = []
    for _ in range(docs):
        doc = random_doc(rng)
        s = g.start()
        for c in doc:
            out.append(s)
            s = run(s, bytes([c]))
        out.append(s)
    return out


def test_masks_equal_a_token_by_token_scan() -> None:
    """allowed(state) = {t : the token's bytes run from the state} (EOS: only once the object is closed), for
    states all along random documents, inside and outside strings and mid-character; served again from the
    per-state store."""
    rng = random.Random(1)
    vocab = synthetic_vocab(rng, 1500)
    eos = len(vocab)
    g = JsonGrammar(vocab + [b"</s>"], [eos], eos + 3)  # two padding rows past the tokenizer's vocabulary
    states = states_along(g, rng, 25)
    assert any(s[0] == 7 and s[2] != 0 for s in states)  # mid-character inside a string
    for s in rng.sample(states, 150):
        m = g.allowed(s)
        want = [vocab[t] is not None and run(s, vocab[t]) is not None for t in range(len(vocab))]
        assert m[: len(vocab)].tolist() == want, s
        assert bool(m[eos]) == (s[0] == DONE) and not m[eos + 1 :].any()
        assert g.allowed(s) is m
        with pytest.raises(ValueError):
            m[0] = True  # shared: read-only


def test_prune_drops_refused_drafts_and_their_subtrees() -> None:
    rng = random.Random(2)
    vocab = synthetic_vocab(rng, 400)
    g = JsonGrammar(vocab + [None], [len(vocab)])
    for s in rng.sample(states_along(g, rng, 6), 40):
        tokens, parents, seen = [7], [-1], set()
        while len(tokens) < 30:
            p, t = rng.randrange(len(tokens)), rng.randrange(len(vocab) + 1)
            if (p, t) not in seen:
                seen.add((p, t))
                tokens.append(t)
                parents.append(p)
        q = torch.full((len(vocab) + 1,), 1.0 / (len(vocab) + 1))
        tree = TokenTree(tuple(tokens), tuple(parents), {0: q, 1: q})
        got, states = prune(g, tree, s)
        alive = [s]
        for i in range(1, len(tree)):
            alive.append(None if alive[tree.parents[i]] is None else g.advance(alive[tree.parents[i]], tree.tokens[i]))
        keep = [i for i, a in enumerate(alive) if a is not None]
        assert list(got.tokens) == [tree.tokens[i] for i in keep]
        assert states == [alive[i] for i in keep]
        for new, old in enumerate(keep[1:], 1):  # parents renumbered
            assert keep[got.parents[new]] == tree.parents[old]
        lost = {tree.parents[i] for i, a in enumerate(alive) if a is None}
        assert set(got.child_q) == {keep.index(k) for k in (0, 1) if k in keep and k not in lost}


def test_constrain_masks_rows_and_undoes() -> None:
    """Sampled rows: -inf exactly on the refused tokens. Greedy rows: left alone where the argmax is allowed,
    masked where not. The undo restores every value."""
    rng = random.Random(3)
    vocab = synthetic_vocab(rng, 300)
    V = len(vocab) + 1
    g = JsonGrammar(vocab + [None], [len(vocab)])
    states = rng.sample(states_along(g, rng, 4), 12)
    gen = torch.Generator().manual_seed(0)
    for greedy in (False, True):
        logits = torch.randn(len(states), V, generator=gen)
        ok_row = 3  # make row 3's argmax an allowed token
        logits[ok_row, int(torch.from_numpy(g.allowed(states[ok_row])).nonzero()[0])] = 50.0
        before = logits.clone()
        undo = constrain_(logits, g, states, greedy)
        masked = 0
        for r, s in enumerate(states):
            allowed = torch.from_numpy(g.allowed(s))
            if greedy and g.allows(s, int(before[r].argmax())):
                assert torch.equal(logits[r], before[r])
            else:
                masked += 1
                assert torch.isinf(logits[r][~allowed]).all() and torch.equal(logits[r][allowed], before[r][allowed])
            assert g.allows(s, int(logits[r].argmax()))
        assert masked >= (1 if greedy else len(states))
        assert not greedy or torch.equal(logits[ok_row], before[ok_row])
        undo()
        assert torch.equal(logits, before)


# a 16-token vocabulary for the tiny model; 15 is EOS
TINY = [b"{", b"}", b'"', b"a", b":", b",", b" ", b"1", b'{"a":', b'"b"', b"[", b"]", b"true", b"0.", b"\n", None]
EOS = 15


def tiny_grammar() -> JsonGrammar:
    return JsonGrammar(TINY, [EOS])


def test_constrained_plain_decoding_step_by_step() -> None:
    """Greedy plain decoding in JSON mode = argmax of the masked full-forward row at each step; its text is a
    JSON object's prefix (closed and then EOS where it ends), and it differs from free decoding."""
    model = tiny(0, vocab=16, scale=2.0)
    engine, g = Engine(model), tiny_grammar()
    closed = 0
    for seed in range(6):
        prompt = [seed, 3, 5, 7]
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=20, grammar=g), drafter=None).token_ids
        ctx, s = list(prompt), g.start()
        with torch.inference_mode():
            for _ in range(20):
                lg, _ = model.forward(torch.tensor([ctx]), torch.arange(len(ctx)), logits_for=slice(-1, None))
                row = lg[0, -1].masked_fill(~torch.from_numpy(g.allowed(s)), float("-inf"))
                ctx.append(int(row.argmax()))
                s = g.advance(s, ctx[-1])
        assert got == ctx[len(prompt) :], seed
        assert got != engine.generate(prompt, GenerationConfig(max_new_tokens=20), drafter=None).token_ids
        closed += EOS in got
        text = b"".join(TINY[t] for t in got[: got.index(EOS)] if t != EOS) if EOS in got else None
        if text is not None:
            assert run(g.start(), text)[0] == DONE
    assert closed >= 1


TINY_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "array", "items": {"type": "boolean"}}},
    "required": ["a"],
}


TINY_UNION = {  # two array branches (side by side after "["), one of bounded numbers
    "type": "object",
    "properties": {
        "a": {
            "anyOf": [
                {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                {"type": "array", "items": {"type": "number", "minimum": 1}},
            ]
        }  # fmt: skip
    },
    "required": ["a"],
}


@pytest.mark.parametrize("schema", [None, TINY_SCHEMA, TINY_UNION], ids=["json_object", "schema", "union"])
@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)], ids=["greedy", "seeded"]
)
def test_speculative_equals_plain_in_json_mode(sampling: SamplingParams, schema: dict | None) -> None:
    """Random trees with right and wrong (often non-JSON) branches: pruned and constrained row by row, the output
    is plain's token for token, with deep paths accepted; under a schema ({"a": [booleans]}, required; or a union
    of two array schemas) every closed answer is valid."""
    g = tiny_grammar().with_schema(schema) if schema else tiny_grammar()
    config = GenerationConfig(max_new_tokens=24, sampling=sampling, grammar=g)
    refs, accepted = random_trees_equal_plain(Engine(tiny(0, vocab=16, scale=2.0)), config)
    closed = 0
    for ref in refs:
        if schema and EOS in ref:
            closed += 1
            text = b"".join(TINY[t] for t in ref[: ref.index(EOS)])
            assert schema_valid(text, schema) and jsonschema_valid(text, schema), text
    assert accepted > 30 and (closed >= 2 or not schema)


class ConstrainedExact(Exact):
    """Exact's plain sequence distribution with each position masked by the automaton (prompt of ``n_prompt``)."""

    def __init__(self, model, params: SamplingParams, g: JsonGrammar, n_prompt: int) -> None:
        super().__init__(model, params)
        self.g, self.n_prompt = g, n_prompt

    def row(self, ctx: Sequence[int]) -> torch.Tensor:
        s = self.g.start()
        for t in ctx[self.n_prompt :]:
            s = self.g.advance(s, t)
        return self.logits(ctx).masked_fill(~torch.from_numpy(self.g.allowed(s)), float("-inf"))


def test_sampled_distribution_in_json_mode_matches_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recursive rejection sampling (forced) over random trees with sampled and top children, pruned by the
    automaton: the sequences' distribution is the constrained plain one (chi-square, 500 draws)."""
    monkeypatch.setattr(treedraft.verify, "uses_coupling", lambda rule, params, tree=None: False)
    V, n, trials = 16, 3, 500
    params = SamplingParams(temperature=0.9)
    g = tiny_grammar()
    model = tiny(4, vocab=V, scale=0.6)
    engine = Engine(model)
    prompt = [1, 5, 2]
    expected = ConstrainedExact(model, params, g, len(prompt)).sequences(prompt, n)
    draft = Exact(tiny(5, vocab=V, scale=0.6), SamplingParams(temperature=1.0))
    drafter = DraftFromQ(draft.probs, 0.3, vocab=V, seed=7, p_sample=0.6, max_children=3, max_depth=3)
    counts: Counter = Counter()
    accepted = 0
    for i in range(trials):
        sampling = SamplingParams(params.temperature, seed=3000 + i)
        r = engine.generate(prompt, GenerationConfig(n, sampling, grammar=g), drafter)
        counts[tuple(r.token_ids)] += 1
        accepted += r.stats.accepted_tokens
    assert set(counts) <= set(expected)  # only JSON prefixes
    assert_fits(counts, expected, "speculative sampling in JSON mode")
    assert accepted > trials / 20


def test_json_mode_config_errors() -> None:
    g = tiny_grammar()
    with pytest.raises(GenerationError, match="ignore_eos"):
        GenerationConfig(grammar=g, ignore_eos=True)
    with pytest.raises(GenerationError, match="min_tokens"):
        GenerationConfig(grammar=g, penalties=Penalties(min_tokens=2, stop_ids=(EOS,)))
    with pytest.raises(ValueError, match="EOS"):
        JsonGrammar(TINY, [])


@pytest.mark.slow
def test_json_mode_real_model(smollm_int4) -> None:
    """The real int4 model: answers in JSON mode parse as objects, and the default drafter's output = plain."""
    llm = smollm_int4
    asks = [
        "List three fruits and their colors as JSON.",
        "Write a short poem about the sea.",  # not a JSON request: the mask has to steer it
    ]
    for q in asks:
        plain = llm.generate(q, drafter=None, max_new_tokens=96, response_format="json_object")
        spec = llm.generate(q, drafter="default", max_new_tokens=96, response_format={"type": "json_object"})
        assert spec.token_ids == plain.token_ids, q
        if plain.finish_reason == "stop":
            assert isinstance(json.loads(plain.text), dict), plain.text
        else:  # cut by max_new_tokens: still a JSON object's prefix
            g = llm._json
            s = g.start()
            for t in plain.token_ids:
                s = g.advance(s, t)
            assert s is not None
    first = llm.generate(asks[0], drafter=None, max_new_tokens=96, response_format="json_object")
    assert first.finish_reason == "stop" and len(json.loads(first.text)) >= 1
    with pytest.raises(GenerationError, match="json_object"):
        llm.generate(asks[0], max_new_tokens=4, response_format="yaml")
    import enum

    import pydantic

    class City(str, enum.Enum):  # pydantic writes it to $defs and refers to it
        paris = "Paris"
        rome = "Rome"

    class Person(pydantic.BaseModel):
        name: str
        age: int = pydantic.Field(ge=0, le=130)  # bounds: a number written within them
        city: City
        nickname: str | None = None  # anyOf string / null

    person = Person.model_json_schema()
    assert "$defs" in person and "anyOf" in json.dumps(person)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    q = "Describe Alice, 30, from Paris."
    plain = llm.generate(q, drafter=None, max_new_tokens=64, response_format=fmt)
    spec = llm.generate(q, drafter="default", max_new_tokens=64, response_format=fmt)
    assert spec.token_ids == plain.token_ids and plain.finish_reason == "stop"
    assert schema_valid(plain.text.encode(), person), plain.text
    assert Person.model_validate_json(plain.text).city in (City.paris, City.rome)
    with pytest.raises(GenerationError, match="'patternProperties'"):
        llm.generate(q, max_new_tokens=4, response_format=fmt | {"json_schema": {"schema": {"patternProperties": {}}}})


@pytest.mark.parametrize("scheme", ["byte-level", "byte-fallback"])
def test_grammar_from_tokenizers_of_both_byte_schemes(scheme: str) -> None:
    """From a real tokenizer object: a JSON text's own tokens run to the closed object (pieces of characters,
    and an added non-special token such as Gemma's "\\n\\n"), special tokens are never allowed, EOS only at the
    end."""
    from test_tokenizer import byte_fallback, byte_level

    from treedraft.tokenizer import Tokenizer

    base = (byte_level if scheme == "byte-level" else byte_fallback)().hf
    hf = base.__class__(tokenizer_object=base.backend_tokenizer.__class__.from_str(base.backend_tokenizer.to_str()))
    hf.eos_token = "<eos>"
    hf.add_tokens(["\n\n"])  # added, not special
    hf.add_special_tokens({"additional_special_tokens": ["<ctl>"]})
    tok = Tokenizer(hf)
    g = JsonGrammar.from_tokenizer(tok)
    eos, ctl, nl2 = hf.eos_token_id, hf.convert_tokens_to_ids("<ctl>"), hf.convert_tokens_to_ids("\n\n")
    assert tok.special_ids >= {eos, ctl} and nl2 not in tok.special_ids
    text = '{"a": "h\u00e9llo w\u00f6rld \u65e5\u672c\u8a9e \U0001f642",\n\n "b": [1, true]}'
    ids = tok.encode(text)
    assert nl2 in ids and b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    s = g.start()
    for t in ids:
        assert not g.allowed(s)[ctl] and not g.allowed(s)[eos]
        assert g.allowed(s)[t]
        s = g.advance(s, t)
    assert s[0] == DONE and g.allowed(s).nonzero()[0].tolist() == [eos]


# ---- JSON Schema (response_format json_schema)


def resolve(sch, root):
    """The schema a $ref / one-schema allOf stands for (local JSON pointers only)."""
    while isinstance(sch, dict) and ("$ref" in sch or "allOf" in sch):
        if "allOf" in sch:
            sch = sch["allOf"][0]
            continue
        cur = root
        for part in sch["$ref"].lstrip("#").split("/")[1:]:
            cur = cur[part]
        sch = cur
    return sch


def conforms(v, sch, root=None) -> bool:
    """The schema subset's meaning, for the reference: declared keys only where ``properties`` is given, integers
    and enum values as their own JSON types (no 1.0 for 1)."""
    root = sch if root is None else root
    sch = resolve(sch, root)
    if sch is True or sch == {}:
        return True
    if sch is False:
        return False
    if "anyOf" in sch:
        return any(conforms(v, b, root) for b in sch["anyOf"])
    if "oneOf" in sch:
        return sum(conforms(v, b, root) for b in sch["oneOf"]) == 1
    if "const" in sch or "enum" in sch:
        vals = [sch["const"]] if "const" in sch else sch["enum"]
        return any(type(v) is type(x) and v == x for x in vals)
    t = sch.get("type") or ("object" if "properties" in sch else "array" if "items" in sch else None)
    types = [t] if isinstance(t, str) else t
    ok_type = {
        "object": isinstance(v, dict),
        "array": isinstance(v, list),
        "string": isinstance(v, str),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool),
        "integer": isinstance(v, int) and not isinstance(v, bool),
        "boolean": isinstance(v, bool),
        "null": v is None,
    }
    if types is not None and not any(ok_type[x] for x in types):
        return False
    if isinstance(v, dict) and not sch.get("minProperties", 0) <= len(v) <= sch.get("maxProperties", len(v)):
        return False
    if isinstance(v, dict) and "properties" in sch:
        props = sch["properties"]
        if not set(v) <= set(props) or not set(sch.get("required", [])) <= set(v):
            return False
        return all(conforms(x, props[k], root) for k, x in v.items())
    if isinstance(v, dict):
        extra = sch.get("additionalProperties", True)
        names = resolve(sch.get("propertyNames", {}), root)
        if {"enum", "const"} & set(names) and not set(v) <= set(names.get("enum", [names.get("const")])):
            return False
        return all(conforms(x, extra, root) for x in v.values())
    if isinstance(v, str) and not sch.get("minLength", 0) <= len(v) <= sch.get("maxLength", len(v)):
        return False
    if isinstance(v, str) and "pattern" in sch and not re.search(sch["pattern"], v, re.ASCII):
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool) and not in_bounds(json.dumps(v).encode(), sch):
        return False
    if isinstance(v, list):
        if not sch.get("minItems", 0) <= len(v) <= sch.get("maxItems", len(v)):
            return False
        prefix, rest = sch.get("prefixItems", []), sch.get("items", {})
        if isinstance(rest, list):  # the older tuple form
            prefix, rest = rest, sch.get("additionalItems", {})
        if sch.get("uniqueItems") and len({json_key(x) for x in v}) < len(v):
            return False
        return all(conforms(x, prefix[i] if i < len(prefix) else rest, root) for i, x in enumerate(v))
    return True


def json_key(v) -> tuple:
    """A scalar's JSON value for equality: numbers by value (1 = 1.0), booleans apart from numbers."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (type(v).__name__, v)
    if isinstance(v, (int, float)):
        return ("n", Fraction(v))
    return ("j", json.dumps(v, sort_keys=True))


def schema_valid(data: bytes, sch: dict) -> bool:
    """reference_valid, no repeated key, and the schema."""
    if not reference_valid(data):
        return False

    def pairs(kv):
        if len({k for k, _ in kv}) != len(kv):
            raise ValueError("repeated key")
        return dict(kv)

    try:
        v = json.loads(data.decode(), object_pairs_hook=pairs)
    except ValueError:
        return False
    return conforms(v, sch)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    k = rng.randrange(9 if depth < 2 else 6)
    if k == 0:
        return {"type": rng.choice(["string", "number", "integer", "boolean", "null"])}
    if k == 1:
        return {"type": ["integer", "null"]}
    if k == 2:
        return {"enum": rng.sample(["ab", "ba", "a", 3, 30, True, None], 3)}
    if k == 3:
        return {"const": rng.choice(["x", 7, False])}
    if k == 4:
        return {}
    if k == 5:
        return {"type": "string", "description": "an annotation"}
    if k == 6:
        return {"type": "array", "items": random_schema(rng, depth + 1)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["a", "ab", "b", "na\u00efve", 'q"t', "x"], rng.randint(0, 4))
    props = {n: random_schema(rng, depth) for n in names}
    return {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.6]}


def instances_and_mutations(rng: random.Random, make_schema, make_instance, second_ref=None) -> None:
    """120 schemas from ``make_schema``: three instances each (``make_instance(rng, schema)``; every prefix alive,
    the whole closed) and six byte mutations of each, accepted exactly when :func:`schema_valid` accepts them (and
    only what ``second_ref(doc, schema)`` accepts, when given)."""
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    ok_seen = bad_seen = 0
    for _ in range(120):
        sch = make_schema(rng)
        g = base.with_schema(sch)
        for _ in range(3):
            doc = json.dumps(make_instance(rng, sch), ensure_ascii=False, indent=rng.choice([None, 1])).encode()
            assert schema_valid(doc, sch) and (second_ref is None or second_ref(doc, sch)), (sch, doc)
            s = g.start()
            for i, c in enumerate(doc):
                s = g.advance(s, c)
                assert s is not None, (sch, doc, i)
            assert s[0] == DONE
            for _ in range(6):
                b = bytearray(doc)
                i = rng.randrange(len(b) + 1)
                c = rng.choice(b'{}[]":,0123456789.-eEtrufalsnabxqv \\')
                if rng.random() < 0.5 or i == len(b):
                    b.insert(i, c)
                else:
                    b[i] = c
                want = schema_valid(bytes(b), sch)
                end = run(g.start(), bytes(b), g.nodes)
                assert (end is not None and end[0] == DONE) == want, (sch, bytes(b))
                if want and second_ref is not None:
                    assert second_ref(bytes(b), sch), (sch, bytes(b))
                ok_seen += want
                bad_seen += not want
    assert ok_seen > 30 and bad_seen > 500


def test_schema_automaton_accepts_exactly_the_valid_objects() -> None:
    """Random schemas (declared keys in any order, required ones, enums, consts, integer / number, nested arrays and
    objects): their random instances (and every prefix) are alive and end closed; byte mutations are accepted
    exactly when Python's parser and the schema's meaning accept them."""
    instances_and_mutations(random.Random(5), random_object_schema, instance)


def test_schema_masks_equal_a_token_by_token_scan() -> None:
    rng = random.Random(6)
    vocab = synthetic_vocab(rng, 1200)
    eos = len(vocab)
    base = JsonGrammar(vocab + [b"</s>"], [eos])
    for i in range(16):  # the first subset's schemas, then references, unions and array bounds
        sch = random_object_schema(rng) if i < 8 else random_full_root(rng)
        g = base.with_schema(sch)
        for _ in range(3):
            inst = instance(rng, sch)
            doc = json.dumps(inst, ensure_ascii=False).encode()
            s = g.start()
            for c in doc:
                m = g.allowed(s)
                want = [vocab[t] is not None and run(s, vocab[t], g.nodes) is not None for t in range(len(vocab))]
                assert m[: len(vocab)].tolist() == want, (sch, s)
                assert m[c] and not m[eos]
                s = run(s, bytes([c]), g.nodes)
            assert g.allowed(s).nonzero()[0].tolist() == [eos]


@pytest.mark.parametrize(
    "schema,match",
    [
        ({"type": "object", "properties": {"a": {"type": "string", "patternProperties": {}}}}, "'patternProperties'"),
        ({"type": "array", "items": {}}, "root must be an object"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
        ({"type": "object", "properties": {"a": {"enum": []}}}, "enum"),
        ({"type": "object", "properties": {"a": {"type": "text"}}}, "type must be"),
        ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "points to nothing"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only references into"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/b", "minItems": 1}}, "$defs": {"b": {}}}, "beside"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "uri-reference"}}}, "'uri-reference'"),
        ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}, "numbers"),
        ({"type": "object", "properties": {"a": {"oneOf": [{"enum": ["x"]}, {"type": "string"}]}}}, "strings"),
        ({"type": "object", "properties": {"a": {"oneOf": [{"type": "object"}, {"type": "object"}]}}}, "objects"),
        ({"type": "object", "properties": {"a": {"anyOf": [{"type": "null"}], "type": "string"}}}, "beside"),
        ({"type": "object", "properties": {"a": {"allOf": [{"type": "null"}, {"type": "null"}]}}}, "exactly one"),
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "refers to itself"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}, "more than max"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": -1}}}, "non-negative"),
        ({"type": "object", "minProperties": 2, "maxProperties": 1}, "more than maxProperties"),
        ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "above 1"),
        (
            {
                "type": "object",
                "properties": {"a": {"oneOf": [{"$ref": "#/$defs/x"}, {"$ref": "#/$defs/x"}]}},
                "$defs": {"x": {"type": "string"}},
            },
            "both take",
        ),  # fmt: skip
        ({"type": "object", "properties": {"a": {}}, "required": [["a"]]}, "required must list"),
        (functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(3000), {}), "too deeply"),
        ({"type": "object", "properties": {"n": {"$ref": "#"}}, "minProperties": 1}, "none is finite"),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1}, "below"),
        ({"type": "object", "properties": {"a": {"type": "integer", "enum": ["x"]}}}, "no enum"),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "none is finite"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "root must be an object"),
        (
            functools.reduce(
                lambda inner, _: {"type": "object", "properties": {"a": inner}, "required": ["a"]},
                range(MAX_DEPTH + 1),  # 33 nested objects (32 + a scalar leaf fit)
                {"type": "integer"},
            ),
            "more than 32 nested",
        ),
    ],
)
def test_unsupported_schemas_are_refused_by_name(schema: dict, match: str) -> None:
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    with pytest.raises(ValueError, match=match):
        g.with_schema(schema)


def can_finish(s: tuple, g: JsonGrammar) -> bool:
    """Whether some bytes take ``s`` to the closed object: a depth-first search over bytes that can write every key
    and value of the test schemas, closers first and openers last (so it closes before it nests), each state once."""
    order = b'}]",:0123456789-.etfrualsnbxqiv\\\xc3\xaf {['
    seen: set = set()

    def dfs(x: tuple, depth: int) -> bool:
        if x[0] == DONE:
            return True
        if depth > 250 or x in seen:
            return False
        seen.add(x)
        return any(y is not None and dfs(y, depth + 1) for y in (run(x, bytes([c]), g.nodes) for c in order))

    return dfs(s, 0)


def test_no_live_state_is_a_dead_end() -> None:
    """Every state the automaton accepts, along instances and along mutated documents up to where it refuses them,
    can still reach a closed object (a dead end would leave a row with no allowed token)."""
    rng = random.Random(8)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    for _ in range(25):
        sch = random_object_schema(rng)
        g = base.with_schema(sch)
        doc = bytearray(json.dumps(instance(rng, sch), ensure_ascii=False).encode())
        for _ in range(3):
            doc.insert(rng.randrange(len(doc) + 1), rng.choice(b'{}[]":,0-etn \\'))
        s, states = g.start(), set()
        for c in doc:
            s = run(s, bytes([c]), g.nodes)
            if s is None:
                break
            states.add(s)
        for s in states:
            assert can_finish(s, g), (sch, s)


EDGE_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": ["number", "null"]},
        "e": {"enum": [3, 30, "x"]},
        'q"t': {"const": True},
        "o": {"type": "object", "properties": {}},
    },
    "required": ["a"],
}


@pytest.mark.parametrize(
    "text,ok",
    [
        (b'{"a": 1}', True),
        (b'{"b": null, "a": -2}', True),  # any order
        (b'{"a": 1, "a": 2}', False),  # a key once
        (b'{"b": 1}', False),  # "a" is required
        (b'{"a": 1.5}', False),  # an integer
        (b'{"a": 1, "b": 1.5e3}', True),
        (b'{"a": 1, "c": 2}', False),  # declared keys only
        (b'{"a": 1, "e": 30}', True),
        (b'{"a": 1, "e": 303}', False),
        (b'{"a": 1, "e": "x"}', True),
        (b'{"a": 1, "e": "xy"}', False),
        (b'{"a": 1, "q\\"t": true}', True),  # an escaped quote inside a key
        (b'{"a": 1, "o": {}}', True),
        (b'{"a": 1, "o": {"k": 1}}', False),  # properties {}: no keys at all
    ],
)
def test_schema_edge_cases(text: bytes, ok: bool) -> None:
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(EDGE_SCHEMA)
    end = run(g.start(), text, g.nodes)
    assert (end is not None and end[0] == DONE) == ok
    assert schema_valid(text, EDGE_SCHEMA) == ok
    every = run(g.start(), b'{"a": 1, "b": 2, "e": 3, "q\\"t": true, "o": {}', g.nodes)
    assert every is not None and run(every, b",", g.nodes) is None  # no key left: no comma (no dead end)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=9)], ids=["greedy", "seeded"]
)
def test_json_mode_with_penalties_and_logprobs(sampling: SamplingParams) -> None:
    """JSON mode on top of penalties, with logprobs: random trees give plain's tokens and logprobs, and every value
    is the model's own log-softmax (both adjustments undone, in the right order, before they are read)."""
    from test_penalties import BOTH

    from treedraft.text import TextGenerator

    model = tiny(0, vocab=16, scale=2.0)
    gen = TextGenerator(Engine(model))
    config = GenerationConfig(max_new_tokens=20, sampling=sampling, grammar=tiny_grammar(), penalties=BOTH, logprobs=2)
    prompt = [3, 1, 4, 1, 5]
    plain = gen.generate(prompt, config, None)
    free = gen.generate(prompt, dataclasses.replace(config, grammar=None, penalties=Penalties()), None)
    assert plain.token_ids != free.token_ids
    seq = prompt + plain.token_ids
    with torch.inference_mode():
        logits, _ = model.forward(torch.tensor([seq]), torch.arange(len(seq)), None, 0)
    ref = logits[0].double().log_softmax(-1)
    for i, lp in enumerate(plain.logprobs):
        assert abs(lp.logprob - float(ref[len(prompt) - 1 + i, lp.token_id])) < 1e-4, i
    for trial in range(4):
        drafter = RandomTreeDrafter(16, seed=trial, oracle=seq, p_right=0.8, max_depth=4)
        spec = gen.generate(prompt, config, drafter)
        assert spec.token_ids == plain.token_ids, trial
        for a, b in zip(spec.logprobs, plain.logprobs, strict=True):  # fp32 rows: the tree's rounding differs
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, trial


def test_grammar_of_another_vocabulary_size_is_refused() -> None:
    engine = Engine(tiny(0, vocab=16))
    short = JsonGrammar(TINY[:15], [14])
    with pytest.raises(GenerationError, match="from_tokenizer"):
        engine.generate([1, 2], GenerationConfig(max_new_tokens=4, grammar=short), drafter=None)


def test_drafts_the_automaton_always_refuses_back_off() -> None:
    """A drafter whose every draft token is refused (pruned to the root): those steps count as failed drafting, so
    the drafting backoff pauses it as it would any drafter that is never accepted."""
    from treedraft.scheduler import BACKOFF_AFTER

    class Refused:
        name = "refused"
        calls = 0

        def propose(self, ctx):
            self.calls += 1
            return TokenTree.chain(ctx.root, [15, 15])  # EOS before the object closes: never allowed

    drafter = Refused()
    engine = Engine(tiny(3, vocab=16, scale=2.0))  # its answer never closes: EOS stays refused
    config = GenerationConfig(max_new_tokens=40, grammar=tiny_grammar())
    ref = engine.generate([0, 3, 5, 7], config, drafter=None).token_ids
    got = engine.generate([0, 3, 5, 7], config, drafter)
    assert got.token_ids == ref and EOS not in ref and len(ref) >= BACKOFF_AFTER + 8
    assert drafter.calls < len(ref) - 4  # paused for some steps


def test_schema_nesting_up_to_the_cap_compiles_and_closes() -> None:
    """32 required nested objects (the automaton's cap) around a scalar: compiled, and the only document closes."""
    sch = functools.reduce(
        lambda inner, _: {"type": "object", "properties": {"a": inner}, "required": ["a"]},
        range(MAX_DEPTH),
        {"type": "integer"},
    )
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(sch)
    end = run(g.start(), b'{"a":' * (MAX_DEPTH - 1) + b'{"a":1' + b"}" * MAX_DEPTH, g.nodes)
    assert end is not None and end[0] == DONE


# ---- references, unions, array bounds, additionalProperties (what pydantic writes)

TREE_DEF = {
    "type": "object",
    "properties": {
        "val": {"type": "integer"},
        "sub": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2},
    },
    "required": ["val"],
    "additionalProperties": False,
}


def random_full_schema(rng: random.Random, depth: int = 0) -> dict:
    k = rng.randrange(12 if depth < 2 else 6)
    if k == 0 and rng.random() < 0.4:  # a length-bounded string
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo} | (
            {"maxLength": lo + rng.randint(0, 3)} if rng.random() < 0.7 else {}
        )
    if k == 0:
        return {"type": rng.choice(["string", "number", "integer", "boolean", "null", ["integer", "null"]])}
    if k == 1:
        return {"enum": rng.sample(["ab", "ba", "a", 3, 30, True, None], 3)}
    if k == 2:
        return {"const": rng.choice(["x", 7, False, None])}
    if k == 3:
        return {}
    if k == 4:
        return {"$ref": "#/$defs/tree", "description": "an annotation beside a reference"}
    if k == 5:
        return {"anyOf": [{"type": rng.choice(["string", "integer", "boolean"])}, {"type": "null"}]}
    if k == 6:
        return {"anyOf": [random_full_object(rng, depth + 1), {"type": "null"}]}
    if k == 7:
        arr = {"type": "array", "items": random_full_schema(rng, depth + 1), "minItems": 1}
        return {"oneOf": [arr, {"enum": ["ab", "ba"]}, {"type": "integer"}]}
    if k == 8:
        return {"allOf": [random_full_schema(rng, depth + 1)], "title": "x"}
    if k == 9:
        lo = rng.randint(0, 2)
        bounds = {"minItems": lo} | ({"maxItems": lo + rng.randint(0, 2)} if rng.random() < 0.7 else {})
        return {"type": "array", "items": random_full_schema(rng, depth + 1), **bounds}
    if k == 10:
        extra = rng.choice([False, {"type": "integer"}, {"$ref": "#/$defs/tree"}, {"anyOf": [{}]}])
        bounds = {"minProperties": rng.randint(0, 1)} if extra is not False and rng.random() < 0.5 else {}
        if bounds and rng.random() < 0.6:
            bounds["maxProperties"] = bounds["minProperties"] + rng.randint(0, 1)
        return {"type": "object", "additionalProperties": extra, **bounds}
    return random_full_object(rng, depth + 1)


def random_full_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["a", "ab", "b", "na\u00efve", 'q"t', "x"], rng.randint(0, 4))
    props = {n: random_full_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    sch = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if rng.random() < 0.3:  # a key count: at least / at most (never below the required ones)
        lo = rng.randint(0, len(names))
        hi = rng.randint(max(lo, len(required)), len(names)) if lo <= len(names) else None
        sch |= {"minProperties": lo} | ({"maxProperties": hi} if hi is not None and rng.random() < 0.7 else {})
    return sch


def random_full_root(rng: random.Random) -> dict:
    return random_full_object(rng) | {"$defs": {"tree": TREE_DEF}}


def full_instance(rng: random.Random, sch, root: dict, depth: int = 0):
    sch = resolve(sch, root)
    if sch == {}:
        return random_value(rng, 3)
    if "anyOf" in sch or "oneOf" in sch:
        return full_instance(rng, rng.choice(sch.get("anyOf") or sch["oneOf"]), root, depth)
    if "const" in sch:
        return sch["const"]
    if "enum" in sch:
        return rng.choice(sch["enum"])
    t = sch.get("type")
    t = rng.choice(t) if isinstance(t, list) else t
    if t == "string" and ("minLength" in sch or "maxLength" in sch):
        n = rng.randint(sch.get("minLength", 0), sch.get("maxLength", sch.get("minLength", 0) + 3))
        return "".join(rng.choice('ab "\\\n\u00e9\U0001f600') for _ in range(n))
    if t == "object" and "properties" in sch:
        props = sch["properties"]
        req = [k for k in props if k in sch.get("required", [])]
        opt = [k for k in props if k not in req]
        rng.shuffle(opt)
        lo = max(0, sch.get("minProperties", 0) - len(req))
        hi = min(len(opt), sch.get("maxProperties", len(props)) - len(req))
        keys = req + opt[: rng.randint(lo, hi)]
        rng.shuffle(keys)
        return {k: full_instance(rng, props[k], root, depth + 1) for k in keys}
    if t == "object":
        extra = sch.get("additionalProperties", True)
        lo = sch.get("minProperties", 0)
        n = 0 if extra is False else lo if depth > 4 else rng.randint(lo, sch.get("maxProperties", lo + 2))
        return {f"k{i}": full_instance(rng, extra, root, depth + 1) for i in range(n)}
    if t == "array":
        prefix, rest = sch.get("prefixItems", []), sch.get("items", {})
        if isinstance(rest, list):
            prefix, rest = rest, sch.get("additionalItems", {})
        lo = sch.get("minItems", 0)
        hi = lo if depth > 4 else sch.get("maxItems", lo + 2)
        if rest is False:
            hi = min(hi, len(prefix))
        return [full_instance(rng, prefix[i] if i < len(prefix) else rest, root, depth + 1)
                for i in range(rng.randint(lo, hi))]  # fmt: skip
    return {
        "string": lambda: "".join(rng.choice('ab "\\\n\u00e9\U0001f600') for _ in range(rng.randint(0, 5))),
        "number": lambda: rng.choice([1.5, -2, 0, 1e-3]),
        "integer": lambda: rng.randint(-50, 50),
        "boolean": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }[t]()


def instance(rng: random.Random, sch: dict):
    """A random instance of a root schema (its references resolved against itself)."""
    return full_instance(rng, sch, sch)


def jsonschema_valid(doc: bytes, sch: dict) -> bool:
    """An independent validator (Draft 2020-12) as a second reference."""
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(sch).is_valid(json.loads(doc))


def test_full_schema_automaton_accepts_exactly_the_valid_objects() -> None:
    """Schemas with $defs / $ref (a recursive one), anyOf / oneOf over JSON types, allOf of one, minItems /
    maxItems, key counts, string lengths and additionalProperties: random instances (every prefix alive) end closed;
    byte mutations are accepted exactly when the subset's meaning accepts them, and only what the jsonschema
    validator accepts."""
    instances_and_mutations(random.Random(15), random_full_root, instance, jsonschema_valid)


def finish(s: tuple, g: JsonGrammar) -> bytes | None:
    """Bytes (no whitespace) that take ``s`` to the closed object, or None: a depth-first search, closers first and
    openers last (so it closes before it nests), each state once (no depth limit: a state that cannot close from
    one path cannot from any)."""
    alphabet = b'}]",:0123456789-._' + bytes(range(0x61, 0x7B)) + bytes(range(0x41, 0x5B)) + b"@+\\\xc3\xaf\xa9{["
    seen = {s}
    path: list[tuple[tuple, int]] = [(s, 0)]  # (state, next alphabet index)
    while path:
        x, i = path[-1]
        if x[0] == DONE:
            return bytes(alphabet[j - 1] for _, j in path[:-1])
        if i == len(alphabet):
            path.pop()
            continue
        path[-1] = (x, i + 1)
        y = run(x, alphabet[i : i + 1], g.nodes)
        if y is not None and y not in seen:
            seen.add(y)
            path.append((y, 0))
    return None


WALK_BYTES = bytes(range(0x20, 0x7F)) + b"\t\n\x01\xc3\xa9\xaf\xe4\xb8\xad\xf0\x9f\x98\x80\xff"


def close_greedily(s: tuple, g: JsonGrammar) -> bytes | None:
    """Bytes that take ``s`` to the closed object, for states :func:`finish`'s search cannot bound (a uniqueItems
    array's carry the item so far, so none repeats): a depth-first search, quote and closers first, that goes at
    most 12 bytes past the last closing bracket it wrote (each one ends a level) and visits 50,000 states at most."""
    order = b'"]}.0123456789' + bytes(range(0x61, 0x7B)) + b",:["
    budget = [50000]

    def dfs(x: tuple, since: int) -> bytes | None:
        if x[0] == DONE:
            return b""
        if since > 12 or budget[0] <= 0:
            return None
        budget[0] -= 1
        for c in order:
            y = run(x, bytes([c]), g.nodes)
            if y is not None:
                rest = dfs(y, 0 if c in b"]}" else since + 1)
                if rest is not None:
                    return bytes([c]) + rest
        return None

    return dfs(s, 0)


def random_walk(rng: random.Random, g: JsonGrammar, nest: float, steps: int, close=None) -> tuple[bytes, list[tuple]]:
    """A document the automaton writes: random allowed bytes (openers taken with probability ``nest`` where
    allowed) for ``steps`` bytes, then the shortest way it finds to close (``close``: another way). Returns it and
    its states."""
    s, out, states = g.start(), bytearray(), []
    for _ in range(steps):
        ok = [c for c in WALK_BYTES if run(s, bytes([c]), g.nodes) is not None]
        if s[0] >= DONE or not ok:
            break
        openers = [c for c in ok if c in b"{[,"]
        c = rng.choice(openers) if openers and rng.random() < nest else rng.choice(ok)
        s = run(s, bytes([c]), g.nodes)
        out.append(c)
        states.append(s)
    rest = (close or finish)(s, g)
    assert rest is not None, (bytes(out), s)  # no dead end
    return bytes(out) + rest, states


def test_random_walks_write_valid_objects() -> None:
    """Whatever bytes the automaton allows, under recursive schemas, unions and array bounds, lead to objects both
    references accept (and the walk can always be closed: no dead end)."""
    rng = random.Random(16)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    schemas = [random_full_root(rng) for _ in range(12)]
    schemas.append({"$ref": "#/$defs/tree", "$defs": {"tree": TREE_DEF}})
    for sch in schemas:
        g = base.with_schema(sch)
        for nest in (0.2, 0.9):
            doc, _ = random_walk(rng, g, nest, 300)
            assert schema_valid(doc, sch) and jsonschema_valid(doc, sch), (sch, doc)


def test_recursive_schemas_at_the_nesting_cap() -> None:
    """Near MAX_DEPTH a recursive schema offers only what still fits: a key whose value needs more levels is not
    offered, a union takes its scalar branch, a free object's keys stop; every state on the way can still close."""
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    empty = {"type": "object", "additionalProperties": False}
    need2 = {"type": "object", "properties": {"n": {"$ref": "#"}, "r": empty}, "required": ["r"]}
    g = base.with_schema(need2)  # an object needs two levels (its required "r" holds an object)
    s = run(g.start(), b'{"n":' * 30 + b"{", g.nodes)
    assert len(s[3]) == 31 and run(s, b'"n', g.nodes) is None and run(s, b'"r":{}}', g.nodes) is not None
    nullable = {"type": "object", "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "r": empty}}
    nullable["required"] = ["r"]
    g = base.with_schema(nullable)
    s = run(g.start(), b'{"n":' * 30 + b'{"n":', g.nodes)
    assert len(s[3]) == 31 and run(s, b"{", g.nodes) is None and run(s, b"null", g.nodes) is not None
    free = {"type": "object", "additionalProperties": {"$ref": "#"}}
    g = base.with_schema(free)
    s = run(g.start(), b'{"k":' * 31 + b"{", g.nodes)
    assert len(s[3]) == 32 and run(s, b'"', g.nodes) is None and run(s, b"}", g.nodes) is not None
    nonempty = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
    lists = {"type": "object", "properties": {"a": {"anyOf": [nonempty, {"type": "null"}]}}}
    g = base.with_schema(lists)  # a non-empty list of objects needs two levels
    s = run(g.start(), b'{"a":[' * 15 + b'{"a":', g.nodes)
    assert len(s[3]) == 31 and run(s, b"[", g.nodes) is None and run(s, b"null}", g.nodes) is not None
    g = base.with_schema({"$ref": "#/$defs/tree", "$defs": {"tree": TREE_DEF}})
    s = run(g.start(), b'{"val":1,"sub":[' * 15 + b'{"val":1,"sub":[', g.nodes)
    assert len(s[3]) == 32 and run(s, b"{", g.nodes) is None and run(s, b"]", g.nodes) is not None
    for sch, doc in ((need2, b'{"n":' * 30 + b'{"r":{}}' + b',"r":{}}' * 30), (nullable, b'{"n":' * 31 + b"null"),
                     (free, b'{"k":' * 31 + b"{"), (lists, b'{"a":[' * 15 + b'{"a":null}' + b"]}" * 15), (TREE_DEF, b'{"sub":[' * 16)):  # fmt: skip
        g = base.with_schema(sch | {"$defs": {"tree": TREE_DEF}} if sch is TREE_DEF else sch)
        s = g.start()
        for c in doc:
            s = run(s, bytes([c]), g.nodes)
            assert s is not None and finish(s, g) is not None, (sch, doc)


def test_pydantic_models_schemas_compile_and_bind() -> None:
    """pydantic's own schemas (nested models through $defs, Optional fields as anyOf with null, str enums,
    Literal, bounded lists, dicts, a recursive model): its dumps of valid models are accepted, and the documents
    random walks write validate as the model."""
    import enum
    from typing import Literal

    pydantic = pytest.importorskip("pydantic")

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        name: str
        age: int | None = None

    class Node(pydantic.BaseModel):
        label: str
        children: list[Node] = []

    class Person(pydantic.BaseModel):
        name: str
        score: float
        color: Color
        pets: list[Pet] = pydantic.Field(min_length=1, max_length=3)
        tags: dict[str, int] = {}
        nick: str | None = None
        tree: Node | None = None

    Node.model_rebuild()
    sch = Person.model_json_schema()
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(sch)
    good = Person(
        name="A \u00e9",
        score=1.5,
        color=Color.blue,
        pets=[Pet(kind="cat", name="Tom", age=3)],
        tags={"x": 1},
        tree=Node(label="r", children=[Node(label="c")]),
    )
    for text in (good.model_dump_json(), good.model_dump_json(indent=2), good.model_dump_json(exclude_none=True)):
        end = run(g.start(), text.encode(), g.nodes)
        assert end is not None and end[0] == DONE, text
    bad = json.loads(good.model_dump_json()) | {"pets": []}  # min_length=1
    assert run(g.start(), json.dumps(bad).encode(), g.nodes) is None
    rng = random.Random(17)
    for nest in (0.1, 0.5, 0.9):
        for _ in range(3):
            doc, _ = random_walk(rng, g, nest, 200)
            Person.model_validate_json(doc)  # raises on an invalid document


COUNTED = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
    "required": ["a"],
    "maxProperties": 2,
    "additionalProperties": False,
}
FREE_COUNTED = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2}


@pytest.mark.parametrize(
    "sch,text,ok",
    [
        (COUNTED, b'{"a":1}', True),
        (COUNTED, b'{"b":1,"a":1}', True),
        (COUNTED, b'{"a":1,"b":1,"c":1}', False),
        (COUNTED, b'{"b":1,"c":1}', False),
        (COUNTED | {"minProperties": 2}, b'{"a":1}', False),
        (COUNTED | {"minProperties": 2}, b'{"c":1,"a":1}', True),
        (FREE_COUNTED, b"{}", False),
        (FREE_COUNTED, b'{"x":1}', True),
        (FREE_COUNTED, b'{"x":1,"y":2}', True),
        (FREE_COUNTED, b'{"x":1,"y":2,"z":3}', False),
    ],
)
def test_key_counts(sch: dict, text: bytes, ok: bool) -> None:
    """minProperties / maxProperties, and with maxProperties only the required keys once the rest has no room (after
    {"b":1, a second optional key would leave "a" no room: a dead end)."""
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(sch)
    end = run(g.start(), text, g.nodes)
    assert (end is not None and end[0] == DONE) == ok == schema_valid(text, sch)
    if sch is COUNTED:
        s = run(g.start(), b'{"b":1,"', g.nodes)
        assert run(s, b"c", g.nodes) is None and run(s, b"a", g.nodes) is not None


# ---- pattern / format (treedraft.pattern)

PATTERNS = [
    "^[a-c]+$", "ab", "^a|b$", "^(ab|c)*d?$", "^[^a]{2,3}$", "x.y", "^\\d{2}-\\w+$", "^(?:a|bc){2}$",
    "^[\u00e9-\u00ff\U0001f600]*$", "^a+?b??$", "\\.\\$", "^[a\\-z]$", "^\\u0061\\x62$", "^\t", "c{2,}",
]  # fmt: skip
ALPHABET = ["a", "b", "c", "d", "x", "y", "z", "-", ".", "$", "1", "2", "\t", '"', "\\", "\u00e9", "\U0001f600"]


def pattern_doc(value: str, ascii_only: bool) -> bytes:
    return json.dumps({"s": value}, ensure_ascii=ascii_only).encode()


def test_patterns_match_as_pythons_re() -> None:
    """Strings under a pattern: the automaton closes the object exactly when Python's re finds the pattern in the
    string (the subset means the same in both here: ASCII classes, no line terminators), whether the string is
    written as UTF-8 or as \\\\u escapes (surrogate pairs for the astral character)."""
    rng = random.Random(21)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    seen = Counter()
    for pat in PATTERNS:
        g = base.with_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": pat}}})
        rx = re.compile(pat, re.ASCII)
        for _ in range(150):
            value = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5)))
            want = rx.search(value) is not None
            for ascii_only in (False, True):
                end = run(g.start(), pattern_doc(value, ascii_only), g.nodes)
                assert (end is not None and end[0] == DONE) == want, (pat, value, ascii_only)
            seen[want] += 1
    assert seen[True] > 100 and seen[False] > 300


def test_patterns_formats_and_lengths_together() -> None:
    """A pattern, a format and a length bound on one string: the automaton closes the object exactly when every one
    of them holds (re.search, the format's pattern, the code point count), UTF-8 or \\u escapes."""
    from treedraft.pattern import FORMATS

    rng = random.Random(26)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    seen = Counter()
    for pat in PATTERNS:
        lo = rng.randint(0, 2)
        hi = lo + rng.randint(0, 3) if rng.random() < 0.7 else -1
        sch = {"type": "string", "pattern": pat, "minLength": lo} | ({"maxLength": hi} if hi >= 0 else {})
        try:
            g = base.with_schema({"type": "object", "properties": {"s": sch}})
        except ValueError as e:
            assert "matches no string" in str(e), (sch, e)
            continue
        rx = re.compile(pat, re.ASCII)
        for _ in range(100):
            value = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
            want = rx.search(value) is not None and lo <= len(value) and (hi < 0 or len(value) <= hi)
            for ascii_only in (False, True):
                end = run(g.start(), pattern_doc(value, ascii_only), g.nodes)
                assert (end is not None and end[0] == DONE) == want, (sch, value, ascii_only)
            seen[want] += 1
    assert seen[True] > 40 and seen[False] > 300
    sch = {"type": "string", "format": "email", "pattern": "^[a-c]", "maxLength": 8}
    g = base.with_schema({"type": "object", "properties": {"s": sch}})
    email = re.compile(FORMATS["email"])
    for value in ("a@b.io", "ab@cd.io", "abc@cd.io", "x@b.io", "a@b", "b.c@d.ef", "\u0061@b.io"):
        want = bool(email.search(value) and value[0] in "abc" and len(value) <= 8)
        end = run(g.start(), pattern_doc(value, False), g.nodes)
        assert (end is not None and end[0] == DONE) == want, value


def test_patterned_masks_equal_a_token_by_token_scan() -> None:
    """Masks in patterned strings (patterns, formats, a pattern with a length bound) come from the pattern's class
    trie: they equal a scan of every token (multi-character tokens, tokens ending inside a character, quotes and
    backslashes) in every state along values written as UTF-8 and as \\u escapes, and a second schema over the same
    vocabulary gets its own trie."""
    rng = random.Random(27)
    vocab = synthetic_vocab(rng, 1500)
    eos = len(vocab)
    base = JsonGrammar(vocab + [b"</s>"], [eos])
    cases = [(p, ["abc", "ab-1", "x\u00e9y", "\u00e9\U0001f600", "12-ab"]) for p in PATTERNS[:10]] + [
        ({"format": "date"}, ["2024-02-28"]),
        ({"format": "email", "maxLength": 12}, ["a.b@cd.io"]),
        ({"pattern": "^[a\u00e9\U0001f600 ]*$", "minLength": 1, "maxLength": 5}, ["a\u00e9 \U0001f600"]),
    ]
    checked = 0
    for sub, values in cases:
        sub = {"pattern": sub} if isinstance(sub, str) else sub
        g = base.with_schema({"type": "object", "properties": {"s": {"type": "string", **sub}}})
        for value in values:
            value = value.encode().decode("unicode_escape")
            for ascii_only in (False, True):
                s = g.start()
                for c in pattern_doc(value, ascii_only):
                    m = g.allowed(s)
                    want = [vocab[t] is not None and run(s, vocab[t], g.nodes) is not None for t in range(len(vocab))]
                    assert m[: len(vocab)].tolist() == want, (sub, value, s)
                    checked += s[0] == PSTR and s[2][1] == 0
                    s = run(s, bytes([c]), g.nodes)
                    if s is None:
                        break
    assert checked > 150


FORMAT_CASES = {
    "date": (["2024-02-28", "1999-12-31", "0001-01-01", "2023-04-30"], ["2024-02-30", "2023-13-01", "2023-4-01", ""]),
    "time": (["23:59:59Z", "00:00:00.123456+05:30", "12:30:00-08:00"], ["24:00:00Z", "12:60:00Z", "12:30:00"]),
    "date-time": (["2024-01-31T08:15:00Z", "2024-06-30T23:00:00.5+02:00"], ["2024-01-31 08:15:00Z", "2024-01-31T08:15Z"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "g23e4567-e89b-12d3-a456-426614174000"]),
    "email": (["a.b+c@example.co.uk", "x@y.io"], ["a@b", "@example.com", "a b@example.com", "a..b@example.com"]),
    "ipv4": (["192.168.0.1", "0.0.0.0", "255.255.255.255"], ["256.1.1.1", "1.2.3", "01.2.3.4"]),
    "ipv6": (["::", "::1", "2001:db8::8a2e:370:7334", "fe80::", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::", "1::8", "A:b::C:d"],
             ["1:2:3:4:5:6:7:8:9", "1:::2", "1::2::3", "12345::", "g::1", ":1:2", "1:2:3:4:5:6:7", "",
              "1:2::3:4:5:6:7:8", "1::2:3:4:5:6:7:8", "1:2:3:4:5:6::7:8"]),
    "hostname": (["localhost", "a", "my-host.example.com", "x1.y2.z3.w4", "a" * 62],
                 ["-a.com", "a-.com", "a..b", ".a", "a.", "a" * 63, "a b", "a.b.c.d.e", "h\u00e9"]),
    "duration": (["P1D", "PT1H", "P1Y2M3DT4H5M6S", "P2W", "PT5M", "PT0S", "P1M", "P10Y1M1D", "PT1H"],
                 ["P", "PT", "P1", "1D", "P1H", "P1W2D", "PT1D", "P1DT", "P1.5D", "P1D2Y", "P10Y1D", "PT1H30S"]),
    "uri": (["https://example.com", "http://a.b:8080/p/a%20th?q=1&r=2#frag", "ftp://1.2.3.4/", "x+y://h/", "s://h#/?"],
            ["example.com", "http://", "http://a b", "http://a:99999", "1http://a", "http://-a.com", "http://a/%zz",
             "http://a/\u00e9", "mailto:x@y.z"]),
    "ipvanyaddress": (["1.2.3.4", "::1", "fe80::1"], ["1.2.3", "1::2::3", "::1.2.3.4", "a"]),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMAT_CASES))
def test_formats_take_their_strings(fmt: str) -> None:
    """Each format: valid strings (and their prefixes) are accepted, invalid ones refused; what is accepted parses
    with Python's own parser for the format where it has one."""
    import datetime
    import ipaddress
    import urllib.parse
    import uuid

    def uri(v: str) -> None:
        parts = urllib.parse.urlsplit(v)
        assert parts.scheme and parts.hostname and (parts.port or 0) >= 0, v

    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    g = g.with_schema({"type": "object", "properties": {"s": {"type": "string", "format": fmt}}, "required": ["s"]})
    good, bad = FORMAT_CASES[fmt]
    parse = {
        "date": datetime.date.fromisoformat,
        "time": datetime.time.fromisoformat,
        "date-time": datetime.datetime.fromisoformat,
        "uuid": uuid.UUID,
        "ipv4": ipaddress.IPv4Address,
        "ipv6": ipaddress.IPv6Address,
        "ipvanyaddress": ipaddress.ip_address,
        "uri": uri,
    }.get(fmt)
    for v in good:
        end = run(g.start(), pattern_doc(v, False), g.nodes)
        assert end is not None and end[0] == DONE, v
        if parse is not None:
            parse(v)
    for v in bad:
        end = run(g.start(), pattern_doc(v, False), g.nodes)
        assert end is None or end[0] != DONE, v


def test_patterned_strings_never_dead_end_and_validate() -> None:
    """Random walks (UTF-8 bytes, escapes, \\\\u escapes and surrogate halves included) under patterns and formats,
    and a pydantic model with date / datetime / UUID / constrained-string fields: every walk can be closed and the
    result matches (re.search / the model's own validation)."""
    import datetime
    import uuid

    pydantic = pytest.importorskip("pydantic")

    class Event(pydantic.BaseModel):
        day: datetime.date
        at: datetime.datetime
        id: uuid.UUID
        code: str = pydantic.Field(pattern="^[A-Z]{3}-\\d{2}$")
        note: str = pydantic.Field(min_length=2, max_length=6)

    rng = random.Random(22)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    for pat in PATTERNS[:9]:
        sch = {"type": "object", "properties": {"s": {"type": "string", "pattern": pat}}, "required": ["s"]}
        g = base.with_schema(sch)
        for nest in (0.0, 0.5):
            doc, _ = random_walk(rng, g, nest, 60)
            assert re.search(pat, json.loads(doc)["s"], re.ASCII), (pat, doc)
    g = base.with_schema(Event.model_json_schema())
    for _ in range(12):
        doc, _ = random_walk(rng, g, 0.3, 150)
        Event.model_validate_json(doc)
    import ipaddress

    host = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")  # RFC 1123, <= 253
    duration = re.compile(r"P(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(\d+H)?(\d+M)?(\d+S)?)?")  # ISO 8601's order
    any_url = pydantic.TypeAdapter(pydantic.AnyUrl)
    check = {
        "uri": any_url.validate_python,  # pydantic's own URL parser takes what the format writes
        "ipv6": ipaddress.IPv6Address,
        "hostname": lambda v: host.fullmatch(v) and len(v) <= 253 or pytest.fail(v),
        "duration": lambda v: duration.fullmatch(v) and v not in ("P", "PT") and not v.endswith("T") or pytest.fail(v),
    }
    for fmt, valid in check.items():
        g = base.with_schema(
            {"type": "object", "properties": {"s": {"type": "string", "format": fmt}}, "required": ["s"]}
        )
        for nest in (0.0, 0.5):
            for _ in range(4):
                doc, _ = random_walk(rng, g, nest, 120)
                valid(json.loads(doc)["s"])


@pytest.mark.parametrize(
    "sch,match",
    [
        ({"type": "string", "pattern": "(a)\\1"}, "not supported"),
        ({"type": "string", "pattern": "(?=a)"}, "lookaround"),
        ({"type": "string", "pattern": "a^b"}, "only at the start"),
        ({"type": "string", "pattern": "[^\\s\\S]"}, "matches no string"),
        ({"type": "string", "pattern": "a{3,2}"}, "below the minimum"),
        ({"type": "string", "pattern": "(ab"}, "missing"),
        ({"type": "string", "format": "iri"}, "'iri' is not supported"),
        ({"type": "string", "format": "date", "pattern": "x"}, "matches no string"),
        ({"type": "string", "maxLength": 2, "pattern": "^abc"}, "matches no string"),
        ({"type": "string", "format": "email", "minLength": 5, "maxLength": 1000}, "too complex together"),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "more than maxLength"),
        ({"type": "string", "minLength": -1}, "non-negative"),
    ],
)
def test_unsupported_patterns_are_refused_by_name(sch: dict, match: str) -> None:
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    with pytest.raises(ValueError, match=match):
        g.with_schema({"type": "object", "properties": {"s": sch}})


def test_length_bounded_strings_masks_and_counts() -> None:
    """minLength / maxLength count characters (code points: a \\\\u pair is one, a UTF-8 sequence is one): the fast
    masks (per-token character counts beside the in-string table) equal a token-by-token scan in every state, tokens
    ending inside a character included, and the bounds hold at the closing quote."""
    rng = random.Random(23)
    vocab = synthetic_vocab(rng, 1500)
    eos = len(vocab)
    sch = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"]}
    g = JsonGrammar(vocab + [b"</s>"], [eos]).with_schema(sch)
    for value in ["ab", "\u00e9\u4e2d\U0001f600", "a\nb\\", "\U0001f600" * 4, 'x"y']:
        for ascii_only in (False, True):
            doc = pattern_doc(value, ascii_only)
            s = g.start()
            for c in doc:
                m = g.allowed(s)
                want = [vocab[t] is not None and run(s, vocab[t], g.nodes) is not None for t in range(len(vocab))]
                assert m[: len(vocab)].tolist() == want, (value, s)
                s = run(s, bytes([c]), g.nodes)
            assert s[0] == DONE
    for value, ok in (("a", False), ("abcd", True), ("abcde", False), ("\U0001f600" * 5, False)):
        for ascii_only in (False, True):
            end = run(g.start(), pattern_doc(value, ascii_only), g.nodes)
            assert (end is not None and end[0] == DONE) == ok, (value, ascii_only)


@pytest.mark.parametrize(
    "prefix,alive",
    [
        (b"\\ud83d", True),  # the high half of U+1F600
        (b"\\ud83e", False),  # a high half none of whose characters the pattern takes
        (b"\\ud83d\\ude01", False),  # U+1F601
        (b"\\u00", True),  # can still become "a"
        (b"\\u01", False),
        (b"\xf0\x9f\x98", True),  # U+1F600's first three bytes
        (b"\xf0\x9f\x99", False),
        (b"\xc3", False),  # U+00C0-U+00FF: none taken
        (b"\\n", False),
    ],
)
def test_patterned_strings_refuse_a_dead_prefix_at_once(prefix: bytes, alive: bool) -> None:
    """Under ^[a\\U0001f600]*$ a UTF-8 sequence or a \\\\u escape is refused at its first byte that leaves only
    characters the pattern refuses (else its row would have no allowed token)."""
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    g = g.with_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a\U0001f600]*$"}}})
    assert (run(g.start(), b'{"s": "' + prefix, g.nodes) is not None) == alive


# ---- numeric bounds (minimum / maximum / exclusiveMinimum / exclusiveMaximum)

PLAIN_NUMBER = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
BOUND_VALUES = [0, 1, -1, 0.5, -0.5, 2.25, 7, 10, 99, 100, -100, 3.14159, 0.05, -0.05, 19.9, 0.999, 1000.5, 1e-3]
STEPS = [0.5, 0.25, 0.125, 1.5, 2, 3, 5, 7, 0.01, 0.3]  # the last two: not binary fractions (no float validator)


def random_bounds(rng: random.Random) -> dict:
    """One or both sides, each inclusive, exclusive (a number), both (the tighter applies) or draft 4's boolean."""
    out: dict = {}
    for inc, exc in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        form = rng.randrange(5)
        if form == 1:
            out[inc] = rng.choice(BOUND_VALUES)
        elif form == 2:
            out[exc] = rng.choice(BOUND_VALUES)
        elif form == 3:
            out[inc], out[exc] = rng.choice(BOUND_VALUES), rng.choice(BOUND_VALUES)
        elif form == 4:
            out[inc], out[exc] = rng.choice(BOUND_VALUES), rng.random() < 0.5
    if rng.random() < 0.35:
        out["multipleOf"] = rng.choice(STEPS)
    return out or {"minimum": rng.choice(BOUND_VALUES)}


def negatives_allowed(sch: dict) -> bool:
    """Whether some negative number (of the schema's type) is within its lower bound."""
    low = []  # (bound, exclusive)
    if type(sch.get("minimum")) in (int, float):
        low.append((Fraction(str(sch["minimum"])), sch.get("exclusiveMinimum") is True))
    if type(sch.get("exclusiveMinimum")) in (int, float):
        low.append((Fraction(str(sch["exclusiveMinimum"])), True))
    if not low:
        return True
    bound, strict = max(low, key=lambda b: (b[0], b[1]))
    if sch.get("type") == "integer":
        return (math.floor(bound) + 1 if strict else math.ceil(bound)) <= -1
    return bound < 0


def in_bounds(text: bytes, sch: dict) -> bool:
    """The reference: a number written without an exponent (an integer without a fraction) whose exact value is
    within the bounds (any number where none are given)."""
    if not {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} & set(sch):
        return True
    if not PLAIN_NUMBER.fullmatch(text) or sch.get("type") == "integer" and b"." in text:
        return False
    v = Fraction(text.decode())
    if text.startswith(b"-") and v == 0 and not negatives_allowed(sch):
        return False  # no negative zero where no negative number is allowed
    for inc, exc, sign in (("minimum", "exclusiveMinimum", 1), ("maximum", "exclusiveMaximum", -1)):
        b = sch.get(inc)
        if b is not None and (sign * (v - Fraction(str(b))) < 0 or sch.get(exc) is True and v == Fraction(str(b))):
            return False
        e = sch.get(exc)
        if not isinstance(e, bool) and e is not None and sign * (v - Fraction(str(e))) <= 0:
            return False
    return "multipleOf" not in sch or (v / Fraction(str(sch["multipleOf"]))).denominator == 1


def number_texts(rng: random.Random, sch: dict) -> list[bytes]:
    """Random number texts (leading zeros, exponents, "-0", fractions) and ones at and around each bound."""
    out = []
    for _ in range(40):
        ip = rng.choice(
            ["0", "00", "07", str(rng.randint(1, 9)), str(rng.randint(10, 120)), str(rng.randint(999, 10**5))]
        )
        fr = rng.choice(["", "", "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4))), "."])
        ex = rng.choice(["", "", "", "e1", "E-2", "e+0"])
        out.append((rng.choice(["", "", "-"]) + ip + fr + ex).encode())
    if "multipleOf" in sch:  # multiples, written as exact decimals
        step = Decimal(repr(sch["multipleOf"]) if isinstance(sch["multipleOf"], float) else sch["multipleOf"])
        out += [format(step * rng.randint(-300, 300), "f").encode() for _ in range(20)]
    for b in (sch.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        if b is not None and not isinstance(b, bool):
            t = format(Decimal(repr(b)) if isinstance(b, float) else Decimal(b), "f")
            for x in (t, t + "0", t + "1", t + ".0", t + ".01", "-" + t, t[:-1] or "0", str(int(Decimal(t)) + 1)):
                out.append(x.replace("--", "").encode())
    return out


def second_ref(doc: bytes, root: dict, sch: dict) -> bool:
    """The jsonschema validator of the bounds' draft: 2020-12 (numeric exclusive bounds), 4 (boolean ones), neither
    where the two sides mix them."""
    jsonschema = pytest.importorskip("jsonschema")
    forms = {type(sch[k]) is bool for k in ("exclusiveMinimum", "exclusiveMaximum") if k in sch}
    if len(forms) > 1 or sch.get("multipleOf") in (0.01, 0.3):  # the validator divides floats: 0.3 / 0.1 != 3
        return True
    validator = jsonschema.Draft4Validator if forms == {True} else jsonschema.Draft202012Validator
    return validator(root).is_valid(json.loads(doc))


def test_number_bounds_take_exactly_the_numbers_within() -> None:
    """Random bounds of every form and steps (multipleOf) on integers and numbers: a number is taken exactly when it
    is written without an exponent and its exact value is within them and a multiple of the step (every such
    number, so nothing allowed is cut off), only what the jsonschema validator accepts; bounds no number fits are
    refused by name."""
    rng = random.Random(23)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    taken = refused = empty = 0
    for _ in range(250):
        sch = {"type": rng.choice(["integer", "number"])} | random_bounds(rng)
        root = {"type": "object", "properties": {"v": sch}, "required": ["v"]}
        texts = number_texts(rng, sch)
        try:
            g = base.with_schema(root)
        except ValueError as e:
            assert "within these bounds" in str(e) or "matches no string" in str(e), (sch, e)
            assert not any(in_bounds(t, sch) for t in texts), (sch, e)
            empty += 1
            continue
        for t in texts:
            doc = b'{"v": ' + t + b"}"
            end = run(g.start(), doc, g.nodes)
            ok = end is not None and end[0] == DONE
            assert ok == in_bounds(t, sch), (sch, t)
            if ok:
                assert second_ref(doc, root, sch), (sch, t)
            taken += ok
            refused += not ok
    assert taken > 500 and refused > 2000 and 5 < empty < 150


def test_bounded_numbers_masks_and_walks() -> None:
    """In bounded numbers (nullable, inside arrays, beside free ones) the masks equal a token-by-token scan over
    multi-byte tokens, and random walks never dead-end and write documents the jsonschema validator accepts."""
    rng = random.Random(24)
    vocab = synthetic_vocab(rng, 1200)
    eos = len(vocab)
    base = JsonGrammar(vocab + [b"</s>"], [eos])
    byte_base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    for _ in range(10):
        while True:
            a, b = random_bounds(rng), random_bounds(rng)
            if any(type(v) is bool or v in (0.01, 0.3) for v in (*a.values(), *b.values())):
                continue  # draft 4's form: not the validator's draft; steps the validator's float division misjudges
            sch = {
                "type": "object",
                "properties": {
                    "a": {"type": ["integer", "null"]} | a,
                    "b": {"type": "array", "items": {"type": "number"} | b},
                    "c": {"type": "number"},
                },
                "required": ["a", "b"],
            }
            try:
                g = base.with_schema(sch)
                break
            except ValueError:
                continue
        for _ in range(2):
            doc, states = random_walk(rng, byte_base.with_schema(sch), 0.4, 80)
            assert jsonschema_valid(doc, sch), (sch, doc)
            for s in rng.sample(states, min(12, len(states))):
                m = g.allowed(s)
                want = [vocab[t] is not None and run(s, vocab[t], g.nodes) is not None for t in range(len(vocab))]
                assert m[: len(vocab)].tolist() == want, (sch, s)


@pytest.mark.parametrize(
    "sch,match",
    [
        ({"type": "integer", "minimum": "1"}, "minimum must be a number"),
        ({"type": "number", "maximum": True}, "maximum must be a number"),
        ({"type": "number", "minimum": 3, "maximum": 2}, "no number is within"),
        ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "no number is within"),
        ({"type": "integer", "minimum": 0.2, "maximum": 0.8}, "minimum 0.2 and maximum 0.8: no integer"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no integer"),
        ({"type": "number", "exclusiveMinimum": True}, "needs minimum"),
        ({"type": "number", "minimum": 1e45}, "more than 40 digits"),
        ({"type": "number", "multipleOf": 0}, "multipleOf must be a number above 0"),
        ({"type": "number", "multipleOf": "2"}, "multipleOf must be a number above 0"),
        ({"type": "number", "multipleOf": 12.125}, "too many digits"),
        ({"type": "number", "multipleOf": 5000, "minimum": -(10**9), "maximum": 10**9}, "too complex together"),
        ({"type": "number", "patternProperties": {}}, "'patternProperties'"),
        ({"enum": [1, 2], "minimum": 5}, "no enum / const value is of type .* within its bounds"),
    ],
)
def test_bad_number_bounds_are_refused_by_name(sch: dict, match: str) -> None:
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    with pytest.raises(ValueError, match=match):
        g.with_schema({"type": "object", "properties": {"v": sch}})


def test_bounds_filter_enums_and_leave_other_types_alone() -> None:
    """An enum keeps only its numbers within the bounds (and its other values); bounds do not constrain strings, and
    a large int64-style range compiles."""
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    sch = {"enum": [1, 2, 3.5, "x", None], "minimum": 2, "exclusiveMaximum": 3.5}
    g2 = g.with_schema({"type": "object", "properties": {"v": sch}, "required": ["v"]})
    kept = [v for v in (b"1", b"2", b"3.5", b'"x"', b"null") if (e := run(g2.start(), b'{"v":' + v + b"}", g2.nodes))
            and e[0] == DONE]  # fmt: skip
    assert kept == [b"2", b'"x"', b"null"]
    g6 = g.with_schema({"type": "object", "properties": {"v": {"enum": [1, 2, 2.5, 10, -4], "multipleOf": 2}}})
    kept = [v for v in (b"1", b"2", b"2.5", b"10", b"-4") if (e := run(g6.start(), b'{"v":' + v + b"}", g6.nodes))
            and e[0] == DONE]  # fmt: skip
    assert kept == [b"2", b"10", b"-4"]
    g3 = g.with_schema({"type": "object", "properties": {"v": {"type": ["string", "integer"], "minimum": 5}}})
    for v, ok in ((b'"3"', True), (b"3", False), (b"5", True)):
        e = run(g3.start(), b'{"v":' + v + b"}", g3.nodes)
        assert (e is not None and e[0] == DONE) == ok, v
    big = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    g4 = g.with_schema({"type": "object", "properties": {"v": big}})
    for v, ok in ((str(2**63 - 1), True), (str(2**63), False), (str(-(2**63)), True), (str(-(2**63) - 1), False)):
        e = run(g4.start(), b'{"v":' + v.encode() + b"}", g4.nodes)
        assert (e is not None and e[0] == DONE) == ok, v
    near = {"type": "integer", "exclusiveMinimum": 2**63, "exclusiveMaximum": 2**63 + 3}  # exact past 28 digits too
    g5 = g.with_schema({"type": "object", "properties": {"v": near}})
    for d in range(-1, 5):
        e = run(g5.start(), b'{"v":' + str(2**63 + d).encode() + b"}", g5.nodes)
        assert (e is not None and e[0] == DONE) == (d in (1, 2)), d


def test_pydantic_constrained_numbers() -> None:
    """pydantic's ge / gt / le / lt / multiple_of fields (conint, PositiveInt, confloat): its dumps of valid models
    are accepted, out-of-range values and non-multiples refused, and random walks write documents the model
    validates."""
    pydantic = pytest.importorskip("pydantic")

    class Review(pydantic.BaseModel):
        stars: int = pydantic.Field(ge=1, le=5)
        weight: float = pydantic.Field(gt=0, lt=1)
        count: pydantic.PositiveInt
        delta: pydantic.conint(ge=-10, lt=10) | None = None
        scores: list[pydantic.confloat(ge=-1.5, le=2.25)] = []
        quarter: float = pydantic.Field(0.0, multiple_of=0.25)
        tens: int = pydantic.Field(0, multiple_of=10, ge=0, le=1000)

    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(Review.model_json_schema())
    good = Review(stars=5, weight=0.25, count=3, delta=-10, scores=[-1.5, 2.25, 0], quarter=-1.75, tens=990)
    for text in (good.model_dump_json(), good.model_dump_json(indent=2), good.model_dump_json(exclude_none=True)):
        end = run(g.start(), text.encode(), g.nodes)
        assert end is not None and end[0] == DONE, text
    for field, value in (("stars", 6), ("stars", 0), ("weight", 1), ("weight", 0), ("count", 0), ("delta", 10),
                         ("scores", [2.5]), ("quarter", 0.3), ("tens", 995), ("tens", 1010)):  # fmt: skip
        bad = json.loads(good.model_dump_json()) | {field: value}
        end = run(g.start(), json.dumps(bad).encode(), g.nodes)
        assert end is None or end[0] != DONE, (field, value)
    rng = random.Random(25)
    for nest in (0.1, 0.5, 0.9):
        for _ in range(3):
            doc, _ = random_walk(rng, g, nest, 200)
            Review.model_validate_json(doc)  # raises on an invalid document


# ---- anyOf / oneOf branches of one JSON type (followed side by side: MULTI states)


def random_union_schema(rng: random.Random, depth: int = 0) -> dict:
    """Unions whose branches share a JSON type: objects (plain, or discriminated by a "kind" const under oneOf),
    numbers, strings under different patterns, nested unions, inside arrays and objects."""
    k = rng.randrange(7 if depth < 2 else 4)
    if k == 0:
        return {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "number", "maximum": 0}, {"type": "null"}]}
    if k == 1:
        return {"anyOf": [{"type": "string", "pattern": "^a+$"}, {"type": "string", "maxLength": 2}, {"enum": ["ab"]}]}
    if k == 2:
        return random_full_schema(rng, 2)
    if k == 3:
        return {"anyOf": [random_full_object(rng, 2), random_full_object(rng, 2)]}
    if k == 4:
        kinds = rng.sample(["a", "b", "c"], 2)
        branches = [
            {"type": "object", "properties": {"kind": {"const": kd}, "v": random_union_schema(rng, depth + 1)},
             "required": ["kind"] + (["v"] if rng.random() < 0.5 else []), "additionalProperties": False}
            for kd in kinds
        ]  # fmt: skip
        return {"oneOf": branches, "discriminator": {"propertyName": "kind"}}
    if k == 5:
        return {"type": "array", "items": random_union_schema(rng, depth + 1), "maxItems": 3}
    return {"anyOf": [random_union_object(rng, depth + 1), random_union_object(rng, depth + 1), {"type": "null"}]}


def random_union_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["a", "ab", "b", "x"], rng.randint(0, 3))
    props = {n: random_union_schema(rng, depth) for n in names}
    return {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.5],
            "additionalProperties": False}  # fmt: skip


def random_union_root(rng: random.Random) -> dict:
    if rng.random() < 0.3:  # a union at the root: any of two object models
        return {"anyOf": [random_union_object(rng), random_union_object(rng)], "$defs": {"tree": TREE_DEF}}
    return random_union_object(rng) | {"$defs": {"tree": TREE_DEF}}


def union_instance(rng: random.Random, sch: dict):
    """An instance of a union root: a branch's instance (``full_instance`` picks a branch of each union)."""
    while True:
        v = full_instance(rng, sch, sch)
        if conforms(v, sch):  # a numeric branch's instance may miss its own bounds (full_instance ignores them)
            return v


def test_same_type_unions_accept_exactly_the_valid_objects() -> None:
    """anyOf over objects, numbers and patterned strings of one type, oneOf over discriminated objects, a union at
    the root: random instances (every prefix alive) end closed; byte mutations are accepted exactly when the
    subset's meaning accepts them, and only what the jsonschema validator accepts."""
    instances_and_mutations(random.Random(28), random_union_root, union_instance, jsonschema_valid)


def test_same_type_unions_walks_and_masks() -> None:
    """Random walks under same-type unions never dead-end and write documents both references accept; masks in
    their side-by-side (MULTI) states equal a token-by-token scan."""
    rng = random.Random(29)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    vocab = synthetic_vocab(rng, 1000)
    eos = len(vocab)
    tok = JsonGrammar(vocab + [b"</s>"], [eos])
    multi = 0
    for _ in range(12):
        sch = random_union_root(rng)
        g, gt = base.with_schema(sch), tok.with_schema(sch)
        for nest in (0.2, 0.6):
            doc, states = random_walk(rng, g, nest, 120)
            assert schema_valid(doc, sch) and jsonschema_valid(doc, sch), (sch, doc)
            for s in [x for x in states if x[0] == MULTI][:6]:
                multi += 1
                m = gt.allowed(s)
                want = [vocab[t] is not None and run(s, vocab[t], gt.nodes) is not None for t in range(len(vocab))]
                assert m[: len(vocab)].tolist() == want, (sch, s)
    assert multi > 20


def test_pydantic_unions_of_models() -> None:
    """pydantic's Union[Cat, Dog] (anyOf), its discriminated form (oneOf + discriminator) and a RootModel of the
    union (a union at the root): the models' dumps are accepted, mixtures of the two refused, random walks
    validate as the model."""
    from typing import Literal

    pydantic = pytest.importorskip("pydantic")

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int
        name: str = ""

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool
        name: str = ""

    class Owner(pydantic.BaseModel):
        pet: Cat | Dog = pydantic.Field(discriminator="kind")
        other: Cat | Dog
        many: list[Cat | Dog] = []

    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    g = base.with_schema(Owner.model_json_schema())
    good = Owner(
        pet=Dog(kind="dog", good=True), other=Cat(kind="cat", lives=9, name="x"), many=[Cat(kind="cat", lives=1)]
    )
    for text in (good.model_dump_json(), good.model_dump_json(indent=2)):
        end = run(g.start(), text.encode(), g.nodes)
        assert end is not None and end[0] == DONE, text
    for bad in ({"kind": "cat", "good": True}, {"kind": "dog", "lives": 1}, {"kind": "cow", "lives": 1}):
        doc = json.loads(good.model_dump_json()) | {"other": bad}
        end = run(g.start(), json.dumps(doc).encode(), g.nodes)
        assert end is None or end[0] != DONE, bad
    rng = random.Random(30)
    for nest in (0.2, 0.5, 0.8):
        for _ in range(3):
            doc, _ = random_walk(rng, g, nest, 200)
            Owner.model_validate_json(doc)
    root = pydantic.RootModel[Cat | Dog]
    g = base.with_schema(root.model_json_schema())
    for v in (Cat(kind="cat", lives=2), Dog(kind="dog", good=False)):
        end = run(g.start(), root(v).model_dump_json().encode(), g.nodes)
        assert end is not None and end[0] == DONE
    for _ in range(4):
        doc, _ = random_walk(rng, g, 0.5, 100)
        root.model_validate_json(doc)


def random_tuple_schema(rng: random.Random, depth: int = 0) -> dict:
    """Arrays of prefixItems (1-3 schemas), then items (a schema, false, or any), with item counts."""
    prefix = [random_full_schema(rng, 2) if depth < 2 and rng.random() < 0.3 else
              {"type": rng.choice(["integer", "string", "boolean", "null"])} for _ in range(rng.randint(1, 3))]  # fmt: skip
    sch: dict = {"type": "array", "prefixItems": prefix}
    rest = rng.choice([False, {"type": "number"}, None, random_tuple_schema(rng, depth + 1) if depth < 2 else False])
    if rest is not None:
        sch["items"] = rest
    lo = rng.randint(0, len(prefix) + 1)
    if rest is False:
        lo = min(lo, len(prefix))
    if rng.random() < 0.6:
        sch["minItems"] = lo
    if rng.random() < 0.5:
        sch["maxItems"] = lo + rng.randint(0, 2)
    return sch


def random_tuple_root(rng: random.Random) -> dict:
    names = rng.sample(["a", "b", "x"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_tuple_schema(rng) for n in names}, "required": names[:1],
            "$defs": {"tree": TREE_DEF}}  # fmt: skip


def test_prefix_items_accept_exactly_the_valid_objects() -> None:
    """prefixItems (tuples) with items after them (a schema, false, any) and item counts: instances and their byte
    mutations against both references; random walks never dead-end and validate."""
    rng = random.Random(31)
    instances_and_mutations(rng, random_tuple_root, instance, jsonschema_valid)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    for _ in range(10):
        sch = random_tuple_root(rng)
        g = base.with_schema(sch)
        for nest in (0.2, 0.7):
            doc, _ = random_walk(rng, g, nest, 100)
            assert schema_valid(doc, sch) and jsonschema_valid(doc, sch), (sch, doc)


def test_tuple_forms_pydantic_and_the_older_items_list() -> None:
    """pydantic's tuple[int, str], tuple[float, ...], NamedTuple and tuple[()] fields; the drafts 4-2019 form (items
    as a list, additionalItems); a prefix item that needs nesting is offered only where it fits."""
    from typing import NamedTuple

    pydantic = pytest.importorskip("pydantic")
    jsonschema = pytest.importorskip("jsonschema")

    class Point(NamedTuple):
        x: float
        y: float

    class Shape(pydantic.BaseModel):
        pair: tuple[int, str]
        many: tuple[float, ...]
        at: Point
        none: tuple[()] = ()

    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    g = base.with_schema(Shape.model_json_schema())
    good = Shape(pair=(1, "a"), many=(1.5, 2.0), at=Point(0.5, -1.0))
    end = run(g.start(), good.model_dump_json().encode(), g.nodes)
    assert end is not None and end[0] == DONE
    for bad in ({"pair": [1]}, {"pair": [1, "a", 2]}, {"pair": ["a", 1]}, {"none": [1]}, {"at": [1, 2, 3]}):
        doc = json.dumps(json.loads(good.model_dump_json()) | bad).encode()
        end = run(g.start(), doc, g.nodes)
        assert end is None or end[0] != DONE, bad
    rng = random.Random(32)
    for nest in (0.2, 0.6):
        for _ in range(3):
            doc, _ = random_walk(rng, g, nest, 150)
            Shape.model_validate_json(doc)
    old = {"type": "object", "properties": {"t": {"type": "array", "items": [{"type": "integer"}, {"type": "null"}],
                                                  "additionalItems": {"type": "string"}}}}  # fmt: skip
    g = base.with_schema(old)
    for t, ok in (("[1, null]", True), ('[1, null, "s", "t"]', True), ("[1, null, 2]", False), ("[null]", False)):
        end = run(g.start(), b'{"t": ' + t.encode() + b"}", g.nodes)
        assert (
            (end is not None and end[0] == DONE) == ok == jsonschema.Draft7Validator(old).is_valid({"t": json.loads(t)})
        )
    with pytest.raises(ValueError, match="beside prefixItems"):
        base.with_schema({"type": "object", "properties": {"t": {"prefixItems": [{}], "items": [{}]}}})
    # a prefix item that needs 3 more levels: at depth 30 only the first (a scalar) and no second item is offered
    deep = functools.reduce(
        lambda inner, _: {"type": "array", "items": inner, "minItems": 1}, range(3), {"type": "null"}
    )
    nested = {"type": "array", "prefixItems": [{"type": "null"}, deep]}
    sch = functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(29), nested)
    g = base.with_schema({"type": "object", "properties": {"t": sch}})
    s = run(g.start(), b'{"t": ' + b"[" * 30 + b"null", g.nodes)
    assert s is not None and run(s, b",", g.nodes) is None and run(s, b"]", g.nodes) is not None


def test_same_type_union_limits() -> None:
    """oneOf over objects without a discriminator is refused by name (a value could match two branches); branches
    that never tell themselves apart multiply per nesting level and stop with a clear error past the cap."""
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    obj = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]}
    with pytest.raises(ValueError, match="discriminator"):
        g.with_schema({"type": "object", "properties": {"p": {"oneOf": [obj, dict(obj)]}}})
    same = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}
    sch = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
           "$defs": {"x": {"anyOf": [same, dict(same, title="twin"), {"type": "null"}]}}}  # fmt: skip
    g2 = g.with_schema(sch)
    doc = b'{"a": ' + b'{"a": ' * 5
    s = run(g2.start(), doc, g2.nodes)
    assert s is not None and s[0] == MULTI and len(s[1]) == 32  # 2 ** 5 ways to have written it
    with pytest.raises(GenerationError, match="branches alive at once"):
        run(s, b'{"a": {"a": ', g2.nodes)


def test_pydantic_url_address_and_plain_string_formats() -> None:
    """AnyUrl (format uri), IPvAnyAddress, and the formats that constrain nothing in JSON (SecretStr's password,
    bytes' binary, Path's path: any string): the model's dump is accepted, and random walks validate as the model."""
    import pathlib

    pydantic = pytest.importorskip("pydantic")

    class Links(pydantic.BaseModel):
        url: pydantic.AnyUrl
        ip: pydantic.IPvAnyAddress
        secret: pydantic.SecretStr
        raw: bytes
        where: pathlib.Path

    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(Links.model_json_schema())
    good = Links(url="https://example.com/a?b=1", ip="::1", secret="s", raw=b'x"\\y', where="/tmp/a b")
    end = run(g.start(), good.model_dump_json().encode(), g.nodes)
    assert end is not None and end[0] == DONE
    rng = random.Random(33)
    for nest in (0.1, 0.5):
        for _ in range(4):
            doc, _ = random_walk(rng, g, nest, 200)
            Links.model_validate_json(doc)


def test_long_max_length_beside_a_pattern_is_counted_not_multiplied() -> None:
    """A pattern with minLength 0 / 1 and a long maxLength (pydantic's HttpUrl: format uri, 1..2083) is counted beside
    the pattern's DFA (LengthBounded): it takes exactly the strings the product automaton takes (random patterns and
    strings, small bounds), its masks equal a scan, and HttpUrl's schema compiles and holds its bound."""
    from treedraft.pattern import Length, LengthBounded, Pattern

    rng = random.Random(34)
    for pat in PATTERNS:
        for lo in (0, 1):
            hi = rng.randint(0, 5)
            try:
                eager = Length(lo, hi).as_pattern() & Pattern(pat)
            except ValueError:
                with pytest.raises(ValueError, match="matches no string"):
                    LengthBounded(Pattern(pat), lo, hi)
                continue
            lazy = LengthBounded(Pattern(pat), lo, hi)
            for _ in range(150):
                value = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7)))
                a, b = 0, 0
                for ch in value:
                    a = eager.next(a, ord(ch)) if a >= 0 else -1
                    b = lazy.next(b, ord(ch)) if b >= 0 else -1
                    assert (a >= 0) == (b >= 0), (pat, lo, hi, value)
                assert (a >= 0 and eager.accepts(a)) == (b >= 0 and lazy.accepts(b)), (pat, lo, hi, value)
    vocab = synthetic_vocab(rng, 1000)
    eos = len(vocab)
    sch = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^[a-z\u00e9]+[.]com$", "maxLength": 70}},
    }
    g = JsonGrammar(vocab + [b"</s>"], [eos]).with_schema(sch)
    assert any(isinstance(n.pattern, LengthBounded) for n in g.nodes)
    s = run(g.start(), b'{"s": "' + b"abc" * 21, g.nodes)  # 63 characters: 7 left, ".com" takes 4
    for c in "ab\u00e9.com".encode():
        m = g.allowed(s)
        want = [vocab[t] is not None and run(s, vocab[t], g.nodes) is not None for t in range(len(vocab))]
        assert m[: len(vocab)].tolist() == want
        s = run(s, bytes([c]), g.nodes)
    assert run(s, b"x", g.nodes) is None and run(s, b'"}', g.nodes)[0] == DONE  # 70: full
    s = run(g.start(), b'{"s": "' + b"abc" * 22, g.nodes)  # 66: only ".com" fits (\\u002e too; no \u00e9)
    assert run(s, "\u00e9".encode()[:1], g.nodes) is None and run(s, b"\\u00e", g.nodes) is None
    pydantic = pytest.importorskip("pydantic")
    model = pydantic.create_model("Page", url=(pydantic.HttpUrl, ...))
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(model.model_json_schema())
    for url, ok in (
        ("https://example.com/a", True),
        ("http://h/" + "a" * 2074, True),
        ("http://h/" + "a" * 2075, False),
    ):
        end = run(g.start(), json.dumps({"url": url}).encode(), g.nodes)
        assert (end is not None and end[0] == DONE) == ok, len(url)


def test_property_names_as_key_enums() -> None:
    """propertyNames as an enum / const of names (pydantic's dict[Literal[...], X] and enum-keyed dicts): only those
    keys, each at most once, values of the additionalProperties schema; both references agree on instances and
    mutations; other propertyNames are refused by name."""
    import enum
    from typing import Literal

    pydantic = pytest.importorskip("pydantic")

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Counts(pydantic.BaseModel):
        by_letter: dict[Literal["x", "y", 'q"t'], int]
        by_color: dict[Color, list[int]] = {}

    sch = Counts.model_json_schema()
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(sch)
    good = Counts(by_letter={"x": 1, 'q"t': 2}, by_color={Color.red: [1, 2]})
    end = run(g.start(), good.model_dump_json().encode(), g.nodes)
    assert end is not None and end[0] == DONE
    for bad in ({"by_letter": {"z": 1}}, {"by_color": {"green": []}}, {"by_letter": {"x": "1"}}):
        end = run(g.start(), json.dumps(json.loads(good.model_dump_json()) | bad).encode(), g.nodes)
        assert end is None or end[0] != DONE, bad
    rng = random.Random(35)
    for _ in range(6):
        doc, _ = random_walk(rng, g, 0.4, 120)
        Counts.model_validate_json(doc)

    def keyed(rng: random.Random) -> dict:
        names = rng.sample(["a", "b", "na\u00efve", "x"], rng.randint(1, 3))
        pn = {"const": names[0]} if len(names) == 1 and rng.random() < 0.5 else {"enum": names}
        extra = rng.choice([{"type": "integer"}, {"type": ["string", "null"]}, {}, False])
        inner = {"type": "object", "propertyNames": pn, "additionalProperties": extra}
        return {"type": "object", "properties": {"m": inner, "n": {"type": "object", "propertyNames": {}}},
                "required": ["m"]}  # fmt: skip

    def keyed_instance(rng: random.Random, sch: dict) -> dict:
        inner = sch["properties"]["m"]
        names = (
            [inner["propertyNames"]["const"]] if "const" in inner["propertyNames"] else inner["propertyNames"]["enum"]
        )
        extra = inner["additionalProperties"]
        keys = [] if extra is False else rng.sample(names, rng.randint(0, len(names)))
        return {"m": {k: full_instance(rng, extra, sch) for k in keys}}

    instances_and_mutations(random.Random(36), keyed, keyed_instance, jsonschema_valid)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    for pn, match in (({"pattern": "^a"}, "enum / const of key names"), ({"enum": ["a"], "type": "integer"}, "enum")):
        with pytest.raises(ValueError, match=match):
            base.with_schema({"type": "object", "properties": {"m": {"type": "object", "propertyNames": pn}}})
    with pytest.raises(ValueError, match="beside properties"):
        base.with_schema({"type": "object", "propertyNames": {"enum": ["a"]}, "properties": {"a": {}}})


# ---- uniqueItems (arrays of scalars)

UNIQUE_ITEMS = [
    {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": ["boolean", "null"]},
    {"type": ["string", "null"]}, {"enum": ["a", "b", 1]}, {"enum": [1, 10, 2.5]}, {"const": "x"},
]  # fmt: skip


def random_unique_root(rng: random.Random) -> dict:
    names = rng.sample(["a", "b", "x"], rng.randint(1, 2))
    props = {}
    for n in names:
        arr = {"type": "array", "items": rng.choice(UNIQUE_ITEMS), "uniqueItems": True}
        if rng.random() < 0.4:
            arr["maxItems"] = rng.randint(1, 4)
        props[n] = arr
    return {"type": "object", "properties": props, "required": names[:1]}


def unique_instance(rng: random.Random, sch: dict) -> dict:
    out = {}
    for n, arr in sch["properties"].items():
        if n not in sch["required"] and rng.random() < 0.3:
            continue
        items, want = [], rng.randint(0, arr.get("maxItems", 4))
        for _ in range(20):
            if len(items) >= want:
                break
            v = full_instance(rng, arr["items"], sch)
            if json_key(v) not in {json_key(x) for x in items}:
                items.append(v)
        out[n] = items
    return out


def test_unique_items_accept_exactly_the_valid_objects() -> None:
    """uniqueItems over strings (escapes: "p" = "\\u0070"), integers, numbers (1 = 1.0), booleans, null and enums:
    instances and byte mutations against both references (repeated values refused, booleans apart from numbers)."""
    instances_and_mutations(random.Random(37), random_unique_root, unique_instance, jsonschema_valid)
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    g = g.with_schema({"type": "object", "properties": {"u": {"type": "array", "items": {"type": ["number", "string",
                                                                "boolean"]}, "uniqueItems": True}}})  # fmt: skip
    for text, ok in (('[1, 1.0]', False), ('[1, true]', True), ('["p", "\\u0070"]', False), ('[0, -0]', False),
                     ('[10, 1e1]', False), ('[1.5, 15e-1]', False), ('["1", 1]', True), ("[false, 0]", True)):  # fmt: skip
        end = run(g.start(), b'{"u": ' + text.encode() + b"}", g.nodes)
        assert (end is not None and end[0] == DONE) == ok, text


def test_unique_items_walks_masks_and_refusals() -> None:
    """Walks never dead-end (an enum's values, once all written, leave no comma; an integer 0 already written is
    not begun again), validate against both references; masks in unique arrays equal a token-by-token scan;
    pydantic's set / frozenset / set[Literal] fields; item schemas it cannot follow are refused by name."""
    from typing import Literal

    pydantic = pytest.importorskip("pydantic")
    rng = random.Random(38)
    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    vocab = synthetic_vocab(rng, 1000)
    eos = len(vocab)
    tok = JsonGrammar(vocab + [b"</s>"], [eos])
    for _ in range(12):
        sch = random_unique_root(rng)
        g, gt = base.with_schema(sch), tok.with_schema(sch)
        for nest in (0.3, 0.8):
            doc, states = random_walk(rng, g, nest, 80, close_greedily)
            assert schema_valid(doc, sch) and jsonschema_valid(doc, sch), (sch, doc)
            for st in rng.sample(states, min(8, len(states))):
                m = gt.allowed(st)
                want = [vocab[t] is not None and run(st, vocab[t], gt.nodes) is not None for t in range(len(vocab))]
                assert m[: len(vocab)].tolist() == want, (sch, st)
    enum2 = base.with_schema({"type": "object", "properties": {"u": {"type": "array", "items": {"enum": ["x", "y"]},
                                                                      "uniqueItems": True}}})  # fmt: skip
    s = run(enum2.start(), b'{"u": ["x", "y"', enum2.nodes)
    assert run(s, b",", enum2.nodes) is None and run(s, b"]", enum2.nodes) is not None
    s = run(enum2.start(), b'{"u": ["x", ', enum2.nodes)
    assert run(s, b'"x', enum2.nodes) is None and run(s, b'"y', enum2.nodes) is not None
    ints = base.with_schema({"type": "object", "properties": {"u": {"type": "array", "items": {"type": "integer"},
                                                                     "uniqueItems": True}}})  # fmt: skip
    s = run(ints.start(), b'{"u": [0, ', ints.nodes)
    assert run(s, b"0", ints.nodes) is None and run(s, b"-0", ints.nodes) is None and run(s, b"1", ints.nodes)

    class Tags(pydantic.BaseModel):
        names: set[str]
        ids: frozenset[int] = frozenset()
        flags: set[Literal["a", "b", "c"]] = set()

    g = base.with_schema(Tags.model_json_schema())
    for _ in range(6):
        doc, _ = random_walk(rng, g, 0.5, 150, close_greedily)
        t = Tags.model_validate_json(doc)
        raw = json.loads(doc)
        assert len(t.names) == len(raw["names"]) and len(t.flags) == len(raw.get("flags", []))
    for items, match in (({"type": "object"}, "uniqueItems is supported"), ({"type": "string", "pattern": "a"},
                         "uniqueItems is supported"), ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "unions")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            base.with_schema({"type": "object", "properties": {"u": {"type": "array", "items": items,
                                                                     "uniqueItems": True}}})  # fmt: skip
    with pytest.raises(ValueError, match="with prefixItems"):
        base.with_schema({"type": "object", "properties": {"u": {"prefixItems": [{}], "uniqueItems": True}}})


def test_schema_traps_a_review_found() -> None:
    """Found by a review of this session's schema code, each failing before its fix: a unique array of numbers took
    "0e" after a 0 (every way on was 0 again: a dead end) and compared 1e30000000 by building the integer (40 s); minItems
    beyond a unique array's distinct values compiled into a dead end; 65 same-type branches compiled and failed
    mid-generation; shared nested unions were walked once per path (2^k); oneOf took 1 and 1.0 as two discriminator
    values; exclusiveMinimum -0.0 failed with an unrelated message."""
    import time

    base = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)

    def obj(v: dict) -> dict:
        return {"type": "object", "properties": {"x": v}, "required": ["x"]}

    nums = base.with_schema(obj({"type": "array", "items": {"type": "number"}, "uniqueItems": True}))
    for doc in (b'{"x":[0,0e', b'{"x":[0,-0.0E', b'{"x":[0.0e5,0e'):
        assert run(nums.start(), doc, nums.nodes) is None, doc
    assert run(nums.start(), b'{"x":[0,0.5,1.25,1e1,10]', nums.nodes) is None  # 10 = 1e1
    assert run(nums.start(), b'{"x":[0,0.5,1.25,1e1,0.1e1]}', nums.nodes)[0] == DONE  # 0.1e1 = 1: new
    t = time.perf_counter()
    assert run(nums.start(), b'{"x":[1e30000000,1E+30000000]', nums.nodes) is None
    assert run(nums.start(), b'{"x":[1e30000000,2e30000000]}', nums.nodes)[0] == DONE and time.perf_counter() - t < 1
    for items, n in (({"type": "boolean"}, 3), ({"enum": ["a", "b"]}, 3), ({"enum": [1, 1.0]}, 2), ({"const": 1}, 2)):
        with pytest.raises(ValueError, match="distinct values"):
            base.with_schema(obj({"type": "array", "items": items, "minItems": n, "uniqueItems": True}))
    with pytest.raises(ValueError, match="65 branches take strings"):
        base.with_schema(obj({"anyOf": [{"type": "string", "pattern": f"^a{i}"} for i in range(65)]}))
    defs = {"U0": {"type": "string"}}
    for i in range(1, 31):
        defs[f"U{i}"] = {"anyOf": [{"$ref": f"#/$defs/U{i - 1}"}, {"$ref": f"#/$defs/U{i - 1}"}]}
    t = time.perf_counter()
    g = base.with_schema(obj({"$ref": "#/$defs/U30"}) | {"$defs": defs})
    assert time.perf_counter() - t < 2.0 and run(g.start(), b'{"x": "s"}', g.nodes)[0] == DONE
    with pytest.raises(ValueError, match="both take objects"):
        base.with_schema({"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                                    {"type": "object", "properties": {"k": {"const": 1.0}}, "required": ["k"]}]})  # fmt: skip
    g = base.with_schema(obj({"type": "number", "exclusiveMinimum": -0.0}))
    end = run(g.start(), b'{"x": 0}', g.nodes)
    assert run(g.start(), b'{"x": 0.5}', g.nodes)[0] == DONE and (end is None or end[0] != DONE)


def test_too_many_union_branches_fail_where_the_token_is_taken_never_in_a_draft() -> None:
    """Two branches that each open a 40-way union: '{' would leave 80 alive (past MAX_ALTERNATIVES). The mask
    (the union of the branches' own masks) lists it; taking it raises the clear error, as plain decoding does when
    it picks it; a draft holding it is pruned instead of failing the request."""
    inner = lambda tag: {"anyOf": [  # noqa: E731
        {"type": "object", "properties": {f"{tag}{i}": {"type": "integer"}}, "required": [f"{tag}{i}"],
         "additionalProperties": False} for i in range(40)]}  # fmt: skip
    sch = {"anyOf": [{"type": "object", "properties": {"a": inner(t)}, "required": ["a"],
                      "additionalProperties": False} for t in "xy"]}  # fmt: skip
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(sch)
    s = run(g.start(), b'{"a":', g.nodes)
    assert s[0] == MULTI and g.allowed(s)[ord("{")] and g.allowed(s)[ord(" ")]
    with pytest.raises(GenerationError, match="anyOf branches alive"):
        g.advance(s, ord("{"))
    tree = TokenTree((ord(":"), ord(" "), ord("{"), ord("{")), (-1, 0, 1, 0))
    kept, states = prune(g, tree, s)
    assert kept.tokens == (ord(":"), ord(" ")) and states[1] == g.advance(s, ord(" "))


def test_enum_strings_keep_to_their_lengths_and_enum_with_pattern_or_format_is_refused() -> None:
    """A review (session 44): an enum or const ignored minLength / maxLength / pattern / format and wrote a value that
    broke them. Lengths now filter the values (in code points); pattern and format next to an enum are refused."""
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257)
    g2 = g.with_schema(
        {"type": "object", "properties": {"v": {"enum": ["a", "bbbb", "é", 7], "maxLength": 2}}, "required": ["v"]}
    )
    kept = [v for v in (b'"a"', b'"bbbb"', '"é"'.encode(), b"7") if (e := run(g2.start(), b'{"v":' + v + b"}", g2.nodes))
            and e[0] == DONE]  # fmt: skip
    assert kept == [b'"a"', '"é"'.encode(), b"7"]
    for extra in ({"pattern": "^a$"}, {"format": "date"}):
        with pytest.raises(ValueError, match="enum / const with (pattern|format) is not supported"):
            g.with_schema({"type": "object", "properties": {"v": {"enum": ["a"], **extra}}})
    with pytest.raises(ValueError, match="within minLength / maxLength"):
        g.with_schema({"type": "object", "properties": {"v": {"const": "abc", "minLength": 4}}})
