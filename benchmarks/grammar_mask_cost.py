"""What a JSON Schema string costs the automaton: the first-time mask of each state while a value is written,
per kind of string (free, length-bounded, formats, restrictive and permissive patterns), on the loaded model's
vocabulary. Masks are cached per state afterwards, so this is the once-per-state cost.

    python benchmarks/grammar_mask_cost.py
"""

from __future__ import annotations

import platform
import time

import treedraft
from treedraft.grammar import JsonGrammar, run

CASES = [
    ("free string", {}, "The quick brown fox jumps over the lazy"),
    ("maxLength 40", {"maxLength": 40}, "The quick brown fox jumps over the lazy"),
    ("format date", {"format": "date"}, "2024-05-17"),
    ("format date-time", {"format": "date-time"}, "2024-05-17T10:30:00Z"),
    ("format uuid", {"format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000"),
    ("pattern ^[A-Za-z ]+$", {"pattern": "^[A-Za-z ]+$"}, "Hello World"),
    ("pattern x (unanchored: permissive)", {"pattern": "x"}, "a x b"),
]


def main() -> None:
    llm = treedraft.load()
    base = JsonGrammar.from_tokenizer(llm.tokenizer, llm.model.vocab_size)
    base.allowed(run(base.start(), b'{"s": "', base.nodes))  # the in-string tables: once per model
    print(f"cpu: {platform.processor() or platform.machine()}; vocabulary {base.vocab_size}")
    for label, sub, value in CASES:
        g = base.with_schema({"type": "object", "properties": {"s": {"type": "string", **sub}}, "required": ["s"]})
        s = run(g.start(), b'{"s": "', g.nodes)
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
