"""Training prompts for the default draft (SmolLM2-135M-Instruct): the recipe, reproducible.

Sources (training files only; never an evaluation file):
  - DATA/gsm8k_train.jsonl: every question (7,473 grade-school maths problems);
  - DATA/self_instruct_seed_tasks.jsonl: every instruction with its instance
    input (175), plus each instruction alone;
  - prompts generated here from templates x word lists written for this recipe, covering the
    kinds of requests a chat model gets (writing, role-play, reasoning, maths, coding,
    extraction, science and humanities explanations, advice), with a fixed seed.

Answers are not taken from anywhere: `specscope train-draft` regenerates every answer with
the target itself. Usage:

    python recipes/default_draft/make_prompts.py --data-dir DATA --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FORMS = ["blog post", "short story", "poem", "persuasive essay", "product description",
         "speech", "cover letter", "review", "social media post", "haiku", "limerick",
         "diary entry", "news article", "letter to a friend", "motivational message",
         "travel guide", "recipe introduction", "movie pitch", "song chorus", "fable",
         "newsletter", "press release", "thank-you note", "job advertisement", "toast"]
TOPICS = ["a rainy afternoon", "learning to cook", "the ocean", "city life", "friendship",
          "a summer road trip", "climate change", "a new smartphone", "remote work",
          "the first day of school", "a mountain hike", "artificial intelligence",
          "healthy breakfasts", "a lost cat", "space exploration", "a small bakery",
          "recycling", "a football match", "winter holidays", "learning a language",
          "electric cars", "a visit to grandparents", "a local library", "gardening",
          "public transport", "volunteering", "a music festival", "time management",
          "a haunted house", "the history of coffee", "a surprise party", "online shopping",
          "a robot that learns to paint", "the importance of sleep", "a trip to Japan",
          "saving money", "a coffee shop", "dogs", "the night sky", "a marathon",
          "social media", "a village by a river", "video games", "a dragon", "the desert",
          "kindness", "a science fair", "an old bicycle", "the future of cities", "tea"]
RECIPIENTS = ["your manager", "a customer", "a teacher", "your landlord", "a new colleague",
              "a hiring manager", "your neighbour", "a supplier", "the city council"]
EMAIL_GOALS = ["asking for a deadline extension", "requesting feedback on a report",
               "apologising for a late delivery", "proposing a new project",
               "inviting them to a meeting", "declining an offer politely",
               "following up on an interview", "reporting a broken heater",
               "thanking them for their help", "asking for a day off"]
PERSONAS = ["a pirate captain", "a medieval knight", "a tour guide in Rome", "a chef",
            "a detective", "a doctor", "a kindergarten teacher", "a sports coach",
            "a librarian", "an astronaut on the Moon", "a wizard", "a museum curator",
            "a personal trainer", "a travel agent", "a stand-up comedian", "a fitness coach",
            "a financial advisor", "a gardener", "a time traveller from 1900", "a barista"]
PERSONA_TASKS = ["Introduce yourself.", "Describe a typical day.",
                 "Give me advice about my week.", "Tell me about your greatest adventure.",
                 "Explain what you love about your job.", "Answer: what should I do today?",
                 "Convince me to try something new.", "Describe your workplace."]
CONCEPTS = ["photosynthesis", "gravity", "inflation", "the water cycle", "DNA", "black holes",
            "machine learning", "supply and demand", "the immune system", "plate tectonics",
            "electricity", "the greenhouse effect", "vaccines", "compound interest",
            "natural selection", "the internet", "blockchain", "nuclear fusion", "probability",
            "the speed of light", "antibiotics", "democracy", "renewable energy", "sound waves",
            "the stock market", "quantum computing", "the human heart", "volcanoes",
            "encryption", "magnetism", "the Big Bang", "cloud computing", "ecosystems",
            "chemical reactions", "the metric system", "tides", "batteries", "neurons",
            "climate vs weather", "opportunity cost"]
EVENTS = ["the French Revolution", "the Industrial Revolution", "the fall of the Roman "
          "Empire", "the invention of the printing press", "the Renaissance",
          "the first Moon landing", "the Silk Road", "the Cold War", "the Great Depression",
          "the discovery of penicillin", "the abolition of slavery", "the rise of the "
          "internet", "the Olympic Games in ancient Greece", "the Age of Exploration"]
PAIRS = [("Plato", "Aristotle"), ("cats", "dogs"), ("tea", "coffee"), ("Python", "Java"),
         ("renting", "buying a home"), ("trains", "planes"), ("books", "films"),
         ("capitalism", "socialism"), ("solar power", "wind power"), ("summer", "winter"),
         ("Mozart", "Beethoven"), ("city life", "country life"), ("email", "phone calls")]
CODE_TASKS = ["reverses a string", "checks whether a number is prime",
              "returns the n-th Fibonacci number", "sorts a list of numbers with bubble sort",
              "counts the vowels in a string", "finds the largest element in a list",
              "removes duplicates from a list", "checks whether a word is a palindrome",
              "computes the factorial of n", "merges two sorted lists",
              "converts Celsius to Fahrenheit", "counts word frequencies in a text",
              "finds the greatest common divisor of two numbers",
              "flattens a nested list", "checks whether brackets are balanced",
              "returns the second largest number in a list", "implements binary search",
              "reads a CSV file and prints the number of rows", "validates an email address",
              "computes the average of a list", "transposes a matrix",
              "generates all permutations of a list", "capitalises every word in a sentence",
              "implements a simple stack class", "computes the sum of digits of a number"]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go"]
ADVICE = ["How can I improve my sleep?", "How do I prepare for a job interview?",
          "What are good ways to stay focused while studying?",
          "How can I start running as a beginner?", "How do I make new friends in a new city?",
          "What should I pack for a weekend camping trip?", "How can I reduce stress at work?",
          "How do I start a vegetable garden?", "How can I save money on groceries?",
          "What are some tips for public speaking?", "How do I learn to play the guitar?",
          "How can I be more productive in the morning?", "How should I plan a birthday "
          "party?", "What are good habits for a healthy life?"]
NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
ITEMS = ["apples", "pencils", "books", "stickers", "marbles", "cookies", "coins", "cards"]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 30), rng.randint(1, 99), rng.randint(100, 500)
    n1, n2 = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    return rng.choice([
        f"Solve for x: {a}x + {b} = {c}.",
        f"What is {a * 7} multiplied by {b}? Show your steps.",
        f"What is the area of a circle with radius {a} cm?",
        f"Find the sum of the first {a + 10} positive integers.",
        f"{n1} has {c} {item} and gives {b} to {n2}. {n2} then gives half of them back. "
        f"How many {item} does {n1} have now?",
        f"A rectangle is {a} m long and {b} m wide. What are its area and perimeter?",
        f"If a train travels at {a * 4} km/h for {rng.randint(2, 9)} hours, how far does it go?",
        f"What is {b}% of {c}?",
        f"Is {c + b} a prime number? Explain.",
        f"A shop sells {item} at ${a} each. How much do {b} {item} cost with a 10% discount?",
        f"Simplify the fraction {a * 6}/{a * 9}.",
        f"What is the average of {a}, {b} and {c}?",
    ])


def _reasoning(rng: random.Random) -> str:
    n1, n2, n3 = rng.sample(NAMES, 3)
    return rng.choice([
        f"{n1} is taller than {n2}, and {n2} is taller than {n3}. Who is the shortest? "
        f"Explain your reasoning.",
        "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies?",
        f"{n1} is older than {n2} but younger than {n3}. List them from youngest to oldest.",
        "A farmer has chickens and cows, 30 heads and 74 legs in total. How many of each?",
        f"{n1} finished a race ahead of {n2} but behind {n3}. Who came first?",
        "What comes next in the sequence 2, 6, 12, 20, 30, ...? Explain the pattern.",
        "If today is Wednesday, what day will it be in 100 days?",
        f"{n1} says: 'I always lie.' Is this statement true or false? Explain.",
    ])


def template_prompts(rng: random.Random, n: int) -> list[str]:
    makers = [
        lambda: f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}.",
        lambda: f"Write a short, professional email to {rng.choice(RECIPIENTS)} "
                f"{rng.choice(EMAIL_GOALS)}.",
        lambda: f"Pretend you are {rng.choice(PERSONAS)}. {rng.choice(PERSONA_TASKS)}",
        lambda: f"Explain {rng.choice(CONCEPTS)} in simple terms.",
        lambda: f"Explain {rng.choice(CONCEPTS)} to a ten-year-old.",
        lambda: f"What are the main causes and consequences of {rng.choice(EVENTS)}?",
        lambda: "Compare {} and {}: what are the main differences?".format(*rng.choice(PAIRS)),
        lambda: f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}.",
        lambda: f"Explain how to write a program that {rng.choice(CODE_TASKS)}, step by step.",
        lambda: rng.choice(ADVICE),
        lambda: _math(rng),
        lambda: _reasoning(rng),
        lambda: f"Give me five interesting facts about {rng.choice(TOPICS)}.",
        lambda: f"Summarise the history of {rng.choice(CONCEPTS)} in a paragraph.",
        lambda: f"List the pros and cons of {rng.choice(TOPICS)}.",
    ]
    out, seen = [], set()
    while len(out) < n:
        p = rng.choice(makers)()
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", dest="shared", required=True,
                    help="the directory holding the source JSONL files (not in this repo)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--templates", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shared = Path(args.shared)
    prompts: list[str] = []
    with (shared / "gsm8k_train.jsonl").open() as f:
        prompts += [json.loads(line)["question"] for line in f if line.strip()]
    with (shared / "self_instruct_seed_tasks.jsonl").open() as f:
        for line in f:
            task = json.loads(line)
            prompts.append(task["instruction"])
            for inst in task["instances"]:
                if inst.get("input", "").strip():
                    prompts.append(f"{task['instruction']}\n\n{inst['input']}")
    rng = random.Random(args.seed)
    prompts += template_prompts(rng, args.templates)
    rng.shuffle(prompts)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
