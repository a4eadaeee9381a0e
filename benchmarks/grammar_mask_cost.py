"""What a JSON Schema value costs the automaton: the first-time mask of each state while a value is written, per
kind of string (free, length-bounded, formats, restrictive and permissive patterns, a pattern or format with a
length bound) and of number (free, bounded), on the loaded model's
vocabulary. Masks are cached per state afterwards, so this is the once-per-state cost.

    python benchmarks/grammar_mask_cost.py
"""

from __future__ import annotations

import platform
import time

import treedraft
from treedraft.grammar import JsonGrammar, run

CASES = [  # (label, the value's schema, its text as written)
    ("free string", {"type": "string"}, '"The quick brown fox jumps over the lazy'),
    ("maxLength 40", {"type": "string", "maxLength": 40}, '"The quick brown fox jumps over the lazy'),
    ("format date", {"type": "string", "format": "date"}, '"2024-05-17'),
    ("format date-time", {"type": "string", "format": "date-time"}, '"2024-05-17T10:30:00Z'),
    ("format uuid", {"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000'),
    ("pattern ^[A-Za-z ]+$", {"type": "string", "pattern": "^[A-Za-z ]+$"}, '"Hello World'),
    ("pattern x (unanchored: permissive)", {"type": "string", "pattern": "x"}, '"a x b'),
    (
        "pattern ^[A-Za-z ]+$ + maxLength 40",
        {"type": "string", "pattern": "^[A-Za-z ]+$", "maxLength": 40},
        '"Hello World and more words',
    ),  # fmt: skip
    ("format email + maxLength 64", {"type": "string", "format": "email", "maxLength": 64}, '"jane.doe@example.com'),
    (
        "union of two objects (MULTI), a free string inside",
        {
            "anyOf": [
                {"type": "object", "properties": {"name": {"type": "string"}, "lives": {"type": "integer"}}},
                {"type": "object", "properties": {"name": {"type": "string"}, "good": {"type": "boolean"}}},
            ]
        },
        '{"name": "Whiskers the grey',
    ),  # fmt: skip
    ("free number", {"type": "number"}, "-1234.5678"),
    ("number 0 < x <= 1000.5", {"type": "number", "exclusiveMinimum": 0, "maximum": 1000.5}, "999.1234"),
    ("integer int64", {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}, "-922337203685477580"),
]


def main() -> None:
    llm = treedraft.load()
    base = JsonGrammar.from_tokenizer(llm.tokenizer, llm.model.vocab_size)
    base.allowed(run(base.start(), b'{"s": "', base.nodes))  # the in-string tables: once per model
    base.allowed(run(base.start(), b'{"s": 1', base.nodes))
    t = time.perf_counter()
    base._string_chars()  # the in-string tokens' characters, for patterned strings' class tries: once per model
    print(f"once per model: in-string characters {(time.perf_counter() - t) * 1e3:.0f} ms")
    print(f"cpu: {platform.processor() or platform.machine()}; vocabulary {base.vocab_size}")
    for label, sub, value in CASES:
        g = base.with_schema({"type": "object", "properties": {"s": sub}, "required": ["s"]})
        s = run(g.start(), b'{"s": ', g.nodes)
        times = []
        for c in value.encode():
            t = time.perf_counter()
            g.allowed(s)
            times.append(time.perf_counter() - t)
            s = run(s, bytes([c]), g.nodes)
        print(f"{label}: {len(times)} states, {sum(times) * 1e3 / len(times):.2f} ms a mask on average, "
              f"max {max(times) * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
