"""A categorised training prompt set, generated from topic lists × phrasings written for this
project (chat, code, math, QA). Every prompt carries its topic; the held-out split is by topic,
so no held-out prompt shares a subject with a training one. Disjoint by construction from the
benchmark prompt set in `profiler/workloads` (different subjects and phrasings)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

CATEGORIES = ("chat", "code", "math", "qa")
HELD_OUT_SHARE = 0.12  # of topics


@dataclass(frozen=True)
class TrainingPrompt:
    id: str
    category: str
    topic: str
    system: str | None
    user: str

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": self.user}]


CHAT_TOPICS = [
    "keeping houseplants alive in a dark flat",
    "sleeping better before an exam",
    "starting to cook at home",
    "saving money on groceries",
    "learning to swim as an adult",
    "training a puppy not to bite",
    "choosing a first bicycle for commuting",
    "making friends after moving to a new city",
    "preparing for a long-haul flight",
    "staying focused while working from home",
    "learning a guitar chord",
    "writing a thank-you note to a teacher",
    "planning a birthday party for a ten-year-old",
    "asking for a raise",
    "dealing with a noisy upstairs neighbour",
    "keeping a journal",
    "reducing screen time in the evening",
    "packing for a camping weekend",
    "organising a small kitchen",
    "cleaning a cast-iron pan",
    "getting back into reading books",
    "choosing running shoes",
    "speaking up in meetings",
    "caring for a sourdough starter",
    "visiting a museum with children",
    "keeping a budget spreadsheet",
    "learning to touch type",
    "hosting a board game night",
    "preparing for a driving test",
    "composting in a small garden",
    "taking better phone photos",
    "staying hydrated during a heatwave",
    "writing a cover letter",
    "choosing a laptop for university",
    "learning to meditate",
    "decluttering a wardrobe",
    "buying a second-hand car",
    "baking bread by hand",
    "recovering from jet lag",
    "painting a bedroom wall",
    "teaching a child to ride a bike",
    "keeping cut flowers fresh",
    "growing tomatoes on a balcony",
    "preparing a short wedding toast",
    "setting up a home aquarium",
    "keeping a cat entertained indoors",
    "improving handwriting",
    "organising digital photos",
    "getting started with birdwatching",
    "planning a week of lunches",
    "volunteering at a food bank",
    "writing a polite complaint email",
    "keeping knees healthy when hiking",
    "learning basic first aid",
    "choosing a houseplant for an office desk",
    "stretching after a desk day",
    "memorising a speech",
    "making cold brew coffee",
    "saying no to extra work politely",
    "moving house with a cat",
    "keeping bread from going stale",
    "planning a road trip on a budget",
    "learning to knit a scarf",
    "preparing for a job fair",
    "getting kids to eat vegetables",
    "remembering people's names",
    "setting up a bird feeder",
    "fixing a squeaky door",
    "choosing a board game for two players",
    "writing a short bedtime story",
    "picking a gym routine",
    "recycling old electronics",
    "caring for leather boots",
    "hosting guests in a small flat",
]
CHAT_PHRASINGS = [
    "Can you give me some practical tips on {t}?",
    "I'd love some advice about {t}. Where should I start?",
    "What are the most common mistakes people make when it comes to {t}?",
    "My friend asked me about {t} and I had no good answer. What would you tell them?",
    "Give me a short step-by-step plan for {t}.",
    "I'm a complete beginner at {t}. What should I know in the first week?",
    "Explain to me, in a friendly way, how to approach {t}.",
    "What is one small thing I could do today that helps with {t}?",
    "Write a short, encouraging message to someone who is struggling with {t}.",
    "List five quick ideas for {t}, one sentence each.",
]
CHAT_SYSTEMS = [
    None,
    None,
    None,
    "You are a helpful assistant.",
    "You are a friendly assistant. Keep answers short and practical.",
    "You are a patient coach who explains things simply.",
]

CODE_TASKS = [
    "reverses the words in a sentence",
    "checks whether a string is a palindrome",
    "counts how often each word appears in a text",
    "returns the n-th Fibonacci number",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping order",
    "finds the largest number in a list without using max",
    "converts Celsius to Fahrenheit",
    "checks whether a number is prime",
    "flattens a nested list",
    "computes the factorial of a number",
    "reads a CSV file and prints the average of one column",
    "validates an email address with a regex",
    "returns the second largest element of a list",
    "counts the vowels in a string",
    "groups a list of words by their first letter",
    "rotates a list by k positions",
    "computes the greatest common divisor of two numbers",
    "sorts a list of dictionaries by a key",
    "finds all anagrams of a word in a list",
    "checks whether brackets in a string are balanced",
    "converts a Roman numeral to an integer",
    "implements binary search on a sorted list",
    "returns the running sum of a list",
    "transposes a matrix given as a list of lists",
    "capitalises the first letter of every word",
    "computes the median of a list of numbers",
    "chunks a list into pieces of size n",
    "finds the longest common prefix of several strings",
    "counts the lines in a text file",
    "checks whether two strings are anagrams",
    "returns the intersection of two lists",
    "converts a decimal number to binary",
    "implements a simple stack class with push and pop",
    "implements a queue using two stacks",
    "computes the sum of the digits of a number",
    "finds the missing number in a range",
    "removes all whitespace from a string",
    "returns the most frequent element of a list",
    "checks whether a year is a leap year",
    "parses a date string and returns the weekday",
    "generates all subsets of a small set",
    "computes the dot product of two vectors",
    "implements bubble sort",
    "implements insertion sort",
    "finds the index of the first repeated character",
    "truncates a string to n characters and adds an ellipsis",
    "builds a dictionary from two lists",
    "counts the words longer than five letters",
    "retries a function call up to three times",
    "measures how long a function takes to run",
    "converts a list of strings to integers safely",
    "splits a full name into first and last name",
    "checks whether a list is sorted",
    "computes compound interest",
    "returns the unique characters of a string in order",
    "finds pairs in a list that add up to a target",
    "caches the results of an expensive function",
    "writes a list of records to a JSON file",
    "validates that a password has a digit and a capital letter",
]
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Go", "Rust", "Java", "C"]
CODE_PHRASINGS = [
    "Write a {lang} function that {t}.",
    "Write a short {lang} function that {t}, with a docstring or comment.",
    "How would I write code in {lang} that {t}? Show the code and explain it briefly.",
    "Give me a {lang} example of a function that {t}, and one example call.",
    "I need a {lang} helper that {t}. Keep it simple.",
]
CODE_EXPLAIN = [
    "What does the {lang} keyword `{kw}` do? Give a small example.",
    "Explain the difference between a list and a tuple in {lang}-like languages, with code.",
]
CODE_KEYWORDS = ["return", "yield", "break", "continue", "lambda", "with", "static", "const", "async", "try"]

MATH_TEMPLATES = [
    (
        "shopping",
        "A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars? Explain step by step.",
    ),
    (
        "shopping",
        "Maria buys {b} apples at {a} cents each and pays with a {c} dollar note. How much change does she get?",
    ),
    ("travel", "A train travels at {a} km per hour for {b} hours. How far does it go? Show your working."),
    ("travel", "A cyclist rides {c} km in {b} hours. What is her average speed?"),
    ("area", "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"),
    ("area", "What is the area of a circle with a radius of {b} metres? Use pi = 3.14."),
    ("fractions", "What is {b}/{c} plus 1/{b}? Give the answer as a simplified fraction."),
    ("fractions", "Simplify the fraction {a}/{d}."),
    ("percent", "A jacket costs {a} dollars and is on sale for {p}% off. What is the sale price?"),
    ("percent", "What is {p}% of {d}? Explain how you worked it out."),
    ("algebra", "Solve for x: {b}x + {a} = {d}."),
    ("algebra", "If 3x - {b} = {a}, what is x? Show each step."),
    ("sequences", "What is the next number in the sequence {b}, {b2}, {b3}, {b4}? Explain the pattern."),
    ("sequences", "What is the sum of the whole numbers from 1 to {a}?"),
    ("time", "A film starts at {h}:15 and lasts {a} minutes. When does it end?"),
    ("time", "How many seconds are there in {b} hours?"),
    ("averages", "The test scores were {a}, {d2}, {c2} and {a2}. What is the mean score?"),
    ("averages", "Find the median of these numbers: {a}, {c}, {b}, {d2}, {a2}."),
    ("ratios", "A recipe uses {b} cups of flour for {c} people. How much flour is needed for {c2} people?"),
    ("ratios", "Split {d} dollars between two people in the ratio {b}:{c}."),
    ("units", "How many centimetres are there in {b}.5 metres?"),
    ("units", "Convert {a} minutes into hours and minutes."),
    ("probability", "A bag has {b} red and {c} blue marbles. What is the probability of drawing a red one?"),
    ("probability", "What is the probability of rolling a total of {s} with two fair dice?"),
    ("arithmetic", "What is {a} times {b}? Explain how to do it in your head."),
    ("arithmetic", "Calculate {d} divided by {b}, and give the remainder."),
    ("geometry", "A triangle has angles of {t1} and {t2} degrees. What is the third angle?"),
    ("geometry", "What is the volume of a cube whose side is {b} cm?"),
    ("money", "If you save {a} dollars a week, how many weeks does it take to save {d2}0 dollars?"),
    ("money", "A loan of {d} dollars has simple interest of {p}% per year. How much interest is paid in {b} years?"),
]

QA_SUBJECTS = [
    "photosynthesis",
    "the water cycle",
    "plate tectonics",
    "the immune system",
    "black holes",
    "the French Revolution",
    "the printing press",
    "the Roman Empire",
    "the Silk Road",
    "the Industrial Revolution",
    "inflation",
    "supply and demand",
    "compound interest",
    "the stock market",
    "central banks",
    "DNA",
    "evolution by natural selection",
    "vaccines",
    "antibiotic resistance",
    "the human heart",
    "the greenhouse effect",
    "ocean tides",
    "earthquakes",
    "volcanoes",
    "hurricanes",
    "the internet",
    "encryption",
    "machine learning",
    "operating systems",
    "databases",
    "the Moon's phases",
    "the seasons",
    "rainbows",
    "gravity",
    "electric circuits",
    "magnetism",
    "sound waves",
    "nuclear fission",
    "solar panels",
    "batteries",
    "democracy",
    "the United Nations",
    "the Olympic Games",
    "the Renaissance",
    "ancient Egypt",
    "the Great Wall of China",
    "the Amazon rainforest",
    "coral reefs",
    "deserts",
    "glaciers",
    "bees and pollination",
    "migratory birds",
    "dinosaurs",
    "fungi",
    "the nitrogen cycle",
    "the metric system",
    "prime numbers",
    "the Pythagorean theorem",
    "probability",
    "statistics",
    "Shakespeare",
    "the novel as a form",
    "jazz",
    "the symphony orchestra",
    "impressionist painting",
    "coffee",
    "chocolate",
    "bread making",
    "fermentation",
    "the spice trade",
    "the periodic table",
    "atoms",
    "chemical reactions",
    "acids and bases",
    "carbon dating",
    "the solar system",
    "Mars",
    "comets",
    "the Big Bang",
    "satellites",
    "sleep",
    "memory",
    "the brain",
    "nutrition",
    "exercise and the heart",
    "maps and projections",
    "time zones",
    "the calendar",
    "languages and dialects",
    "writing systems",
    "bridges",
    "skyscrapers",
    "the steam engine",
    "airplanes and lift",
    "electric cars",
]
QA_PHRASINGS = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Why is {t} important?",
    "Give me three interesting facts about {t}.",
    "How does {t} work?",
    "Summarise what a student should know about {t} in a short paragraph.",
    "What is a common misconception about {t}?",
    "Answer briefly: what is the main idea behind {t}?",
]


def _stable_share(text: str) -> float:
    """A number in [0, 1) fixed by the text alone (not Python's salted hash)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8


def held_out_topic(category: str, topic: str) -> bool:
    return _stable_share(f"{category}/{topic}") < HELD_OUT_SHARE


def _chat(rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for topic in CHAT_TOPICS:
        for j, phrasing in enumerate(rng.sample(CHAT_PHRASINGS, 6)):
            system = rng.choice(CHAT_SYSTEMS)
            out.append(TrainingPrompt(f"chat/{topic}/{j}", "chat", topic, system, phrasing.format(t=topic)))
    return out


def _code(rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for topic in CODE_TASKS:
        for j, phrasing in enumerate(CODE_PHRASINGS):
            user = phrasing.format(lang=rng.choice(CODE_LANGUAGES), t=topic)
            out.append(TrainingPrompt(f"code/{topic}/{j}", "code", topic, None, user))
    for keyword in CODE_KEYWORDS:
        for j, lang in enumerate(("Python", "JavaScript")):
            user = CODE_EXPLAIN[0].format(lang=lang, kw=keyword)
            out.append(TrainingPrompt(f"code/keyword {keyword}/{j}", "code", f"keyword {keyword}", None, user))
    return out


def _math_values(rng: random.Random) -> dict[str, int]:
    a, b, c = rng.randint(12, 95), rng.randint(2, 9), rng.randint(3, 12)
    t1 = rng.randint(30, 90)
    return {
        "a": a,
        "b": b,
        "c": c,
        "d": rng.randint(100, 960),
        "p": rng.choice([5, 10, 15, 20, 25, 30, 40]),
        "b2": b * 2,
        "b3": b * 3,
        "b4": b * 4,
        "h": rng.randint(1, 9),
        "s": rng.randint(3, 11),
        "a2": rng.randint(40, 99),
        "c2": rng.randint(13, 30),
        "d2": rng.randint(50, 99),
        "t1": t1,
        "t2": rng.randint(20, 170 - t1),
    }


def _math(rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for i, (topic, template) in enumerate(MATH_TEMPLATES):
        for j in range(14):
            user = template.format(**_math_values(rng))
            out.append(TrainingPrompt(f"math/{topic}/{i}/{j}", "math", topic, None, user))
    return out


def _qa(rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for topic in QA_SUBJECTS:
        for j, phrasing in enumerate(rng.sample(QA_PHRASINGS, 5)):
            out.append(TrainingPrompt(f"qa/{topic}/{j}", "qa", topic, None, phrasing.format(t=topic)))
    return out


def training_prompts(seed: int = 0) -> list[TrainingPrompt]:
    """Every prompt of the set, in a fixed order (the seed picks phrasings and numbers)."""
    rng = random.Random(seed)
    return [*_chat(rng), *_code(rng), *_math(rng), *_qa(rng)]


def split(prompts: list[TrainingPrompt]) -> tuple[list[TrainingPrompt], list[TrainingPrompt]]:
    """(train, held-out), by topic: a held-out topic's prompts are all held out."""
    train = [p for p in prompts if not held_out_topic(p.category, p.topic)]
    held = [p for p in prompts if held_out_topic(p.category, p.topic)]
    return train, held
