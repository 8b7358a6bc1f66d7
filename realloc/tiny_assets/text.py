"""A small English corpus and prompt files made from templates, for the tiny tokenizer and tests.

Everything is a pure function of the seed, so the files shipped in ``experiments/data/`` can be
re-made byte for byte with ``python -m realloc.tiny_assets.hf data --out experiments/data``.
Prompts carry an ``answer`` next to the question (a rule reward may check it; the loader ignores it).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CORPUS_FILE = "tiny_corpus.txt"
TEXT_PROMPTS_FILE = "text_prompts.jsonl"
CHAT_PROMPTS_FILE = "chat_prompts.jsonl"

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kira", "Leo", "Mira", "Nico",
         "Omar", "Pia", "Rosa", "Sam", "Tess", "Uma", "Vik", "Wren", "Yara", "Zed"]
PLACES = ["market", "library", "harbor", "garden", "bakery", "station", "museum", "school", "river", "hill",
          "forest", "workshop"]
ITEMS = ["apples", "bread", "a red kite", "two books", "fresh fish", "a blue lamp", "some rope", "a map", "seeds",
         "a small clock", "honey", "paint"]
COUNTABLE = ["apples", "pears", "stones", "shells", "coins", "cards", "pencils", "marbles", "eggs", "buttons"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "foggy", "quiet", "bright"]
TOWNS = ["Harrowmere", "Lindqvist Bay", "Osterfield", "Quillbrook", "Sablewick", "Tarn Hollow", "Vellmoor",
         "Wyncrest"]
KNOWN_FOR = ["stone bridges", "blue pottery", "tall clock tower", "apple orchards", "boat races", "winter fair",
             "wool blankets", "old lighthouse"]
ANIMALS = [("dog", "barks", "bones"), ("cat", "purrs", "fish"), ("cow", "moos", "grass"), ("horse", "neighs", "hay"),
           ("duck", "quacks", "bread crumbs"), ("sheep", "bleats", "grass"), ("owl", "hoots", "mice"),
           ("frog", "croaks", "flies")]
FEELINGS = ["happy", "tired", "curious", "proud", "surprised", "calm", "hungry", "excited"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
FACTS = [  # (question, answer sentence, short answer)
    ("How many legs does a spider have?", "A spider has eight legs.", "eight"),
    ("How many legs does a bird have?", "A bird has two legs.", "two"),
    ("How many days are in a week?", "A week has seven days.", "seven"),
    ("How many months are in a year?", "A year has twelve months.", "twelve"),
    ("What color is grass?", "Grass is green.", "green"),
    ("What color is snow?", "Snow is white.", "white"),
    ("What is the opposite of hot?", "The opposite of hot is cold.", "cold"),
    ("What is the opposite of up?", "The opposite of up is down.", "down"),
    ("What comes after Monday?", "Tuesday comes after Monday.", "Tuesday"),
    ("What comes before Sunday?", "Saturday comes before Sunday.", "Saturday"),
    ("Which is larger, a cat or a mouse?", "A cat is larger than a mouse.", "a cat"),
    ("What do bees make?", "Bees make honey.", "honey"),
    ("Where do fish live?", "Fish live in water.", "in water"),
    ("What do we use to write on paper?", "We use a pencil or a pen to write on paper.", "a pencil"),
]
SYSTEM = ["You are a helpful assistant. Answer briefly.", "You answer questions with one short sentence.",
          "You are a patient teacher who explains simple things."]


def _story(r: random.Random) -> tuple[str, str, str]:
    """A few sentences about two people; returns (text, who went, where)."""
    a, b = r.sample(NAMES, 2)
    place, item, weather, feeling = r.choice(PLACES), r.choice(ITEMS), r.choice(WEATHER), r.choice(FEELINGS)
    sentences = [f"On a {weather} morning, {a} walked to the {place} to buy {item}.",
                 f"{b} was already there and waved hello.",
                 f"They talked about the {r.choice(TOWNS)} fair and the {r.choice(KNOWN_FOR)}.",
                 f"After an hour, {a} felt {feeling} and went home with {item}.",
                 f"{b} stayed a little longer to help at the {r.choice(PLACES)}.",
                 f"In the evening it became {r.choice(WEATHER)}, so both of them stayed inside and read."]
    return " ".join(sentences[:r.randint(2, len(sentences))]), a, place


def _sum(r: random.Random) -> tuple[int, int, str]:
    x, y = r.randint(0, 10), r.randint(0, 10)
    return x, y, r.choice(COUNTABLE)


def _town(r: random.Random) -> str:
    town, known = r.choice(TOWNS), r.choice(KNOWN_FOR)
    people = r.randrange(300, 9000, 50)
    return (f"{town} is a small town by a slow river. About {people} people live there. It is known for its {known}, "
            f"and visitors come every {r.choice(['spring', 'summer', 'autumn', 'winter'])} to see it.")


def _animal(r: random.Random) -> str:
    (animal, sound, food), name = r.choice(ANIMALS), r.choice(NAMES)
    return (f"{name} has a {animal}. The {animal} {sound} when it is {r.choice(FEELINGS)}, and it likes to eat "
            f"{food}. Every {r.choice(WEATHER)} day they go to the {r.choice(PLACES)} together.")


def corpus(seed: int = 0, n_paragraphs: int = 320) -> str:
    r = random.Random(seed)
    out = []
    for _ in range(n_paragraphs):
        kind = r.randrange(6)
        if kind == 0:
            out.append(_story(r)[0])
        elif kind == 1:
            x, y, things = _sum(r)
            out.append(f"{NUMBER_WORDS[x].capitalize()} plus {NUMBER_WORDS[y]} is {NUMBER_WORDS[x + y]}. If you have "
                       f"{x} {things} and get {y} more, you have {x + y} {things}. {x} + {y} = {x + y}.")
        elif kind == 2:
            q, a, _ = r.choice(FACTS)
            out.append(f"Question: {q} Answer: {a}")
        elif kind == 3:
            out.append(_town(r))
        elif kind == 4:
            out.append(_animal(r))
        else:
            q, a, _ = r.choice(FACTS)
            out.append(f"User: {q}\nAssistant: {a}")
    return "\n\n".join(out) + "\n"


def _question(r: random.Random) -> tuple[str, str]:
    """A question of a random kind and length, with its short answer."""
    kind = r.randrange(4)
    if kind == 0:
        x, y, _ = _sum(r)
        return f"What is {x} plus {y}?", str(x + y)
    if kind == 1:
        x, y, things = _sum(r)
        name = r.choice(NAMES)
        return f"{name} has {x} {things} and finds {y} more. How many {things} does {name} have now?", str(x + y)
    if kind == 2:
        q, _, a = r.choice(FACTS)
        return q, a
    text, who, place = _story(r)
    if r.random() < 0.5:
        text = _town(r) + " " + text
    return f"{text} Where did {who} walk to?", f"the {place}"


def text_prompts(seed: int = 1, n: int = 48) -> list[dict]:
    r = random.Random(seed)
    return [{"prompt": q, "answer": a} for q, a in (_question(r) for _ in range(n))]


def chat_prompts(seed: int = 2, n: int = 48) -> list[dict]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": r.choice(SYSTEM)}] if r.random() < 0.4 else []
        if r.random() < 0.3:  # an earlier exchange before the question
            q, a, _ = r.choice(FACTS)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        q, a = _question(r)
        out.append({"messages": messages + [{"role": "user", "content": q}], "answer": a})
    return out


def write_all(out_dir: str | Path) -> list[Path]:
    """Write the corpus and both prompt files into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {CORPUS_FILE: corpus(),
             TEXT_PROMPTS_FILE: "".join(json.dumps(p) + "\n" for p in text_prompts()),
             CHAT_PROMPTS_FILE: "".join(json.dumps(p) + "\n" for p in chat_prompts())}
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return [out_dir / name for name in files]
