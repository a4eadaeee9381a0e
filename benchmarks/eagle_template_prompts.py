"""Template prompts across eight kinds of request (writing, role-play, reasoning, math, coding, extraction, STEM,
humanities), for testing whether the EAGLE drafter's gap between held-out ShareGPT answers (top-1 ~0.61) and
MT-Bench answers (~0.50) is one of topic coverage: the ShareGPT prompt file is mostly chat, advice and code, while
MT-Bench spreads over these eight kinds. The target's own answers to these prompts are EAGLE training data like
any other (``treedraft train-eagle --gen-only --prompts OUT``); nothing here is taken from MT-Bench: the kinds
are generic and every template, topic and number is written or drawn here.

    python benchmarks/eagle_template_prompts.py --n 1600 --seed 0 --out /path/prompts.jsonl

Writes ``{"id", "prompt"}`` lines (the ShareGPT prompt file's format), deduplicated, in a seeded order, and prints
how many each kind got: the kinds are drawn in turn, and a kind whose templates run out of distinct prompts
leaves its turns to the others (at --n 1600 --seed 0, the session-18 set: extraction 337, math 306, reasoning
302, writing 258, role-play 203, coding 98, STEM 71, humanities 25).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOPICS = [
    "a small coastal town",
    "learning a second language",
    "remote work",
    "urban gardening",
    "a rainy afternoon",
    "electric cars",
    "a childhood friend",
    "the first day at a new job",
    "saving money",
    "a mountain hike",
    "public libraries",
    "a lost dog",
    "climate adaptation in cities",
    "a jazz concert",
    "online privacy",
    "a family recipe",
    "volunteering",
    "space tourism",
    "a night market",
    "sleep habits",
    "board games",
    "a school science fair",
    "renewable energy",
    "a long train journey",
    "minimalism",
    "a bakery opening",
    "ocean plastic",
    "a chess tournament",
    "museum visits",
    "time management",
    "a winter festival",
    "smartphone addiction",
    "a historic bridge",
    "beekeeping",
    "a marathon",
    "artificial intelligence in schools",
]
FORMS = [
    "a short story",
    "a blog post",
    "a poem",
    "a product description",
    "a formal email to a manager",
    "a two-minute speech",
    "a persuasive essay",
    "a diary entry",
    "a news article",
    "a cover letter",
    "a limerick",
    "a restaurant review",
    "a travel itinerary for three days",
    "a letter to a friend",
    "a social media post",
    "a short dialogue between two characters",
]
PERSONAS = [
    "a pirate captain",
    "a medieval knight",
    "a hard-boiled detective",
    "a pastry chef",
    "a tour guide in Rome",
    "a fitness coach",
    "a customer support agent for an internet provider",
    "a 19th-century naturalist",
    "an astronaut on the space station",
    "a kindergarten teacher",
    "a grumpy librarian",
    "a startup founder",
    "a marine biologist",
    "a wise old farmer",
    "a stand-up comedian",
    "a museum curator",
]
PERSONA_ASKS = [
    "Describe your typical day.",
    "Give me advice about {topic}.",
    "What do you think about {topic}?",
    "Tell me about the hardest moment of your career.",
    "Convince me to try {topic}.",
    "Introduce yourself to a new apprentice.",
]
CODE_TASKS = [
    "reverses the words in a sentence",
    "checks whether a string is a palindrome",
    "merges two sorted lists",
    "counts how often each word appears in a text",
    "returns the n-th Fibonacci number",
    "parses one line of CSV",
    "validates an email address",
    "computes the median of a list of numbers",
    "implements binary search",
    "removes duplicates from a list while keeping the order",
    "converts a Roman numeral to an integer",
    "finds the longest common prefix of a list of strings",
    "transposes a matrix",
    "flattens a nested list",
    "checks whether two strings are anagrams",
    "returns the prime factors of a number",
    "finds the two numbers in an array that add up to a target",
    "rotates an array by k positions",
]
LANGS = ["Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go"]
SQL_TASKS = [
    "lists the five customers with the highest total order value",
    "finds employees who earn more than their department's average salary",
    "counts orders per month for the last year",
    "returns products that were never ordered",
]
CONCEPTS = [
    "photosynthesis",
    "entropy",
    "plate tectonics",
    "how vaccines train the immune system",
    "quantum entanglement",
    "how a neural network learns",
    "black holes",
    "DNA replication",
    "Ohm's law",
    "the greenhouse effect",
    "natural selection",
    "how a transistor works",
    "the Doppler effect",
    "radioactive decay",
    "how GPS works",
    "the water cycle",
    "supply and demand",
    "inflation",
    "compound interest",
    "how antibiotics work",
    "the speed of light as a limit",
    "chemical equilibrium",
    "how batteries store energy",
    "tides",
]
EVENTS = [
    "the French Revolution",
    "the fall of the Western Roman Empire",
    "the invention of the printing press",
    "the Industrial Revolution",
    "the Silk Road",
    "the Renaissance in Italy",
    "the end of the Cold War",
    "the abolition of slavery in the British Empire",
    "the Meiji Restoration",
    "the moon landing",
    "the Protestant Reformation",
    "the spread of the internet",
]
THINKERS = ["Socrates", "Confucius", "Immanuel Kant", "Simone de Beauvoir", "John Locke", "Adam Smith", "Hannah Arendt"]
PAIRS = [
    ("democracy", "monarchy"),
    ("Impressionism", "Cubism"),
    ("Stoicism", "Epicureanism"),
    ("a novel", "a film adaptation"),
    ("classical music", "jazz"),
    ("capitalism", "socialism"),
]
NAMES = ["Alice", "Bob", "Chen", "Dara", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
ITEMS = ["apples", "notebooks", "tickets", "plants", "coffee bags", "pencils", "books", "shirts"]
COMPANIES = ["Northwind Ltd", "Bluefin Systems", "Acorn Foods", "Helios Energy", "Quarry Labs", "Maple Retail"]


def _writing(r: random.Random) -> str:
    return f"Write {r.choice(FORMS)} about {r.choice(TOPICS)}."


def _roleplay(r: random.Random) -> str:
    ask = r.choice(PERSONA_ASKS).format(topic=r.choice(TOPICS))
    return f"Pretend you are {r.choice(PERSONAS)}. {ask}"


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 19), r.randint(3, 60), r.randint(61, 400)
    kind = r.randrange(7)
    if kind == 0:
        n, p = r.randint(2, 12), r.randint(2, 15)
        return f"A shop sells {r.choice(ITEMS)} for ${p} each. If I buy {n} and pay with ${n * p + r.randint(1, 50)}, how much change do I get?"
    if kind == 1:
        return f"Solve for x: {a}x + {b} = {c}. Show each step."
    if kind == 2:
        return f"What is the area and the perimeter of a rectangle that is {a} m by {b} m?"
    if kind == 3:
        return f"Find the derivative of f(x) = {a}x^3 - {b}x^2 + {r.randint(1, 9)}x - {r.randint(1, 20)}."
    if kind == 4:
        return f"What is {r.choice([5, 12, 15, 20, 35, 40])}% of {c}? Explain how you computed it."
    if kind == 5:
        return f"Two fair dice are rolled. What is the probability that the sum is {r.randint(2, 12)}?"
    return f"A train travels {c} km in {r.randint(2, 6)} hours. What is its average speed, and how long would {b} km take at that speed?"


def _reasoning(r: random.Random) -> str:
    x, y, z = r.sample(NAMES, 3)
    kind = r.randrange(4)
    if kind == 0:
        return f"{x} is taller than {y}, and {y} is taller than {z}. Who is the shortest? Explain your reasoning."
    if kind == 1:
        n, k = r.randint(5, 30), r.randint(1, 4)
        return f"{x} has {n} {r.choice(ITEMS)} and gives {k} to each of {r.randint(2, 5)} friends. How many are left? Think step by step."
    if kind == 2:
        return f"If every {r.choice(['cat', 'bird', 'robot'])} in the village is {r.choice(['blue', 'loud', 'old'])} and {x} owns one, what can we conclude, and what can we not conclude?"
    return f"{x}, {y} and {z} each chose a different fruit: apple, pear or plum. {x} did not choose the apple, and {y} chose the pear. Who chose what?"


def _coding(r: random.Random) -> str:
    if r.random() < 0.15:
        return f"Write an SQL query that {r.choice(SQL_TASKS)}."
    return f"Write a {r.choice(LANGS)} function that {r.choice(CODE_TASKS)}, with a short explanation."


def _extraction(r: random.Random) -> str:
    co, name = r.choice(COMPANIES), r.choice(NAMES)
    rev, growth = r.randint(12, 900), r.randint(-15, 40)
    text = (
        f"On {r.choice(['March', 'June', 'October'])} {r.randint(1, 28)}, {co} reported quarterly revenue of "
        f"${rev} million, a change of {growth}% from a year earlier. Its chief executive, {name}, said the company "
        f"would open {r.randint(2, 20)} new offices and hire {r.randint(50, 900)} people."
    )
    what = r.choice(
        ["the company name, revenue and growth", "every number with what it measures", "the people and their roles"]
    )
    return f"Extract {what} from the following text and return them as JSON.\n\n{text}"


def _stem(r: random.Random) -> str:
    return r.choice(
        [
            "Explain {c} in simple terms.",
            "Explain {c} to a high-school student, with an example.",
            "What are common misconceptions about {c}?",
        ]
    ).format(c=r.choice(CONCEPTS))


def _humanities(r: random.Random) -> str:
    kind = r.randrange(3)
    if kind == 0:
        return f"Discuss the causes and consequences of {r.choice(EVENTS)}."
    if kind == 1:
        a, b = r.choice(PAIRS)
        return f"Compare {a} and {b}: what do they share and where do they differ?"
    return f"What were the main ideas of {r.choice(THINKERS)}, and why do they still matter?"


KINDS = [_writing, _roleplay, _reasoning, _math, _coding, _extraction, _stem, _humanities]


def prompts(n: int, seed: int, counts: dict[str, int] | None = None) -> list[str]:
    """n distinct prompts, the eight kinds in turn (a duplicate draw gives its turn to the next kind), drawn with
    ``seed``; ``counts`` (optional) receives how many each kind got."""
    r = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        kind = KINDS[tries % len(KINDS)]
        p = kind(r)
        tries += 1
        if p not in seen:
            seen.add(p)
            out.append(p)
            if counts is not None:
                name = kind.__name__.lstrip("_")
                counts[name] = counts.get(name, 0) + 1
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct prompts from these templates; ask for fewer than {n}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    counts: dict[str, int] = {}
    ps = prompts(a.n, a.seed, counts)
    a.out.write_text("".join(json.dumps({"id": f"tmpl-{i}", "prompt": p}) + "\n" for i, p in enumerate(ps)))
    print(
        f"{len(ps)} prompts -> {a.out}; per kind: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    )


if __name__ == "__main__":
    main()
