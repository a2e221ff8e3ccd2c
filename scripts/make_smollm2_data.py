"""Write the SmolLM2 recipes' data into recipes/smollm2/: two-digit additions in the chat format.

    python scripts/make_smollm2_data.py [--out recipes/smollm2]

A pure function of this script (fixed seed, no downloads), so the shipped files can be
regenerated and diffed. The task: "What is 37 + 48?" answered with the sum alone ("85"). The base
model (benchmarks/real_model.py) answers such sums wrong more often than right and wordily; the
fine-tune teaches it the sum and the terse format. Every split's pairs are disjoint from the
others'. The same module makes the learning benchmark's third protocol's prompts
(benchmarks/learning/protocol3.py): the held-out splits, the varied instructions whose base-model
answers measure forgetting, and the facts the base model already knows.

- train.jsonl (400) / eval.jsonl (48): SFT rows, `messages` (user, assistant).
- preference.jsonl (400): the same prompts with `chosen` the sum and `rejected` a near miss
  (off by ten or by one, the base model's kind of mistake), for recipes/smollm2-135m-dpo.yaml.
- prompts.jsonl (400): the same prompts as chat prompts with the sum as `answer`, for
  recipes/smollm2-135m-grpo.yaml (its exact_match reward).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

SEED = 2054
N_TRAIN, N_EVAL = 400, 48


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def addition_pairs(n: int, seed: int = SEED) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs of two-digit numbers in a fixed order: slices of it never overlap."""
    pairs = list(itertools.product(range(10, 100), repeat=2))
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def chat_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": question(a, b)},
                         {"role": "assistant", "content": str(a + b)}]}


def preference_row(a: int, b: int, rng: random.Random) -> dict:
    near_miss = a + b + rng.choice([-10, 10, -1, 1])
    return {"prompt": [{"role": "user", "content": question(a, b)}],
            "chosen": [{"role": "assistant", "content": str(a + b)}],
            "rejected": [{"role": "assistant", "content": str(near_miss)}]}


def prompt_row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)}


def splits(sizes: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
    """Disjoint slices of one shuffled list of pairs, in the order the sizes are given; the
    recipes' train and eval come first, so any later split is held out from both."""
    pairs = addition_pairs(sum(sizes.values()))
    out, lo = {}, 0
    for name, n in sizes.items():
        out[name], lo = pairs[lo:lo + n], lo + n
    return out


# Forgetting: varied instructions (questions, writing, lists, code), made from templates.
_TOPICS = ["the ocean", "autumn", "a city at night", "friendship", "the moon", "an old library", "rain",
           "a mountain village"]
_THINGS = ["a rainbow", "a volcano", "photosynthesis", "a computer", "the internet", "gravity", "a vaccine",
           "an eclipse", "a bicycle", "democracy"]
_CATEGORIES = ["fruits", "colors", "musical instruments", "animals that live in the sea", "European countries",
               "kitchen tools", "sports played with a ball", "planets", "things to pack for a trip", "flowers"]
_CODE = ["returns the sum of a list of numbers", "reverses a string", "checks whether a number is even",
         "counts the vowels in a word", "returns the largest of three numbers", "prints the numbers from 1 to 10",
         "converts Celsius to Fahrenheit", "removes duplicates from a list", "returns the length of a list",
         "checks whether a word is a palindrome"]
_ADVICE = ["sleep better", "learn a new language", "save money", "stay focused while studying", "make new friends",
           "start running", "keep a plant alive", "prepare for a job interview"]


def instructions() -> list[str]:
    """The fixed instruction set (>= 200) of forgetting measure (a)."""
    out = [f"Write a short poem about {t}." for t in _TOPICS]
    out += [f"Write two sentences describing {t}." for t in _TOPICS]
    out += [f"What is {t}?" for t in _THINGS]
    out += [f"Explain {t} to a child." for t in _THINGS]
    out += [f"Give one interesting fact about {t}." for t in _THINGS]
    out += [f"List three {c}." for c in _CATEGORIES]
    out += [f"Name five {c}." for c in _CATEGORIES]
    out += [f"What are some {c}?" for c in _CATEGORIES]
    out += [f"Write a Python function that {c}." for c in _CODE]
    out += [f"Show me JavaScript code that {c}." for c in _CODE]
    out += [f"How can I {a}?" for a in _ADVICE]
    out += [f"Give me three tips to {a}." for a in _ADVICE]
    out += [f"Write a short story that begins with {t}." for t in _TOPICS]
    out += [f"Summarize in one sentence why {t} matters." for t in _THINGS]
    out += [f"Which of these is the odd one out: {c}, or a chair? Explain." for c in _CATEGORIES]
    out += [f"Write a haiku about {t}." for t in _TOPICS]
    out += [f"What questions would a child ask about {t}?" for t in _THINGS]
    out += [f"Write a friendly email inviting a friend to talk about {t}." for t in _TOPICS]
    out += [f"What is a common mistake when trying to {a}?" for a in _ADVICE]
    out += [f"Write a tweet about {t}." for t in _THINGS]
    out += [f"Describe {t} in three words." for t in _THINGS]
    out += [f"What is the best way to {a}?" for a in _ADVICE]
    return out


# Forgetting: facts; the protocol keeps those the base model gets right (answer contains the word).
FACTS = [
    ("What is the capital of France?", "Paris"), ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"), ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Japan?", "Tokyo"), ("What is the capital of England?", "London"),
    ("What is the capital of Russia?", "Moscow"), ("What is the capital of China?", "Beijing"),
    ("What is the capital of Egypt?", "Cairo"), ("What is the capital of Greece?", "Athens"),
    ("What is the capital of Canada?", "Ottawa"), ("What is the capital of Australia?", "Canberra"),
    ("What is the capital of Portugal?", "Lisbon"), ("What is the capital of Ireland?", "Dublin"),
    ("What is the capital of Austria?", "Vienna"), ("What is the capital of Norway?", "Oslo"),
    ("What is the capital of Sweden?", "Stockholm"), ("What is the capital of Poland?", "Warsaw"),
    ("What is the capital of the United States?", "Washington"), ("What is the capital of India?", "Delhi"),
    ("What color is the sky on a clear day?", "blue"), ("What color is grass?", "green"),
    ("What color is snow?", "white"), ("What color is a banana?", "yellow"),
    ("What color is a ripe tomato?", "red"), ("What color is coal?", "black"),
    ("How many days are in a week?", "seven"), ("How many legs does a spider have?", "eight"),
    ("How many legs does a dog have?", "four"), ("How many months are in a year?", "twelve"),
    ("What is the opposite of hot?", "cold"), ("What is the opposite of up?", "down"),
    ("What is the opposite of big?", "small"), ("What is the opposite of day?", "night"),
    ("What is the opposite of fast?", "slow"), ("What is the opposite of happy?", "sad"),
    ("What is the largest planet in our solar system?", "Jupiter"), ("What planet do we live on?", "Earth"),
    ("What is the closest star to Earth?", "Sun"), ("What gas do plants absorb from the air?", "carbon dioxide"),
    ("What do bees make?", "honey"), ("What is frozen water called?", "ice"),
    ("What animal is known as the king of the jungle?", "lion"), ("Which animal says moo?", "cow"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"), ("What language is spoken in Brazil?", "Portuguese"),
    ("What is the largest ocean on Earth?", "Pacific"), ("What is the chemical symbol for water?", "H2O"),
    ("What is the tallest mountain in the world?", "Everest"), ("What is the longest river in Africa?", "Nile"),
]
FACT_ANSWERS_WITH_DIGITS = {"seven": "7", "eight": "8", "four": "4", "twelve": "12"}


def fact_right(answer: str, expected: str) -> bool:
    """The expected word (or its digits) anywhere in the answer, ignoring case."""
    text = answer.lower()
    return expected.lower() in text or FACT_ANSWERS_WITH_DIGITS.get(expected, "\0") in text


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description="Write the SmolLM2 recipes' data.")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes" / "smollm2"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    s = splits({"train": N_TRAIN, "eval": N_EVAL})
    write_jsonl(out / "train.jsonl", [chat_row(a, b) for a, b in s["train"]])
    write_jsonl(out / "eval.jsonl", [chat_row(a, b) for a, b in s["eval"]])
    rng = random.Random(SEED)
    write_jsonl(out / "preference.jsonl", [preference_row(a, b, rng) for a, b in s["train"]])
    write_jsonl(out / "prompts.jsonl", [prompt_row(a, b) for a, b in s["train"]])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
