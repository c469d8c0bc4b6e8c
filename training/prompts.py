"""The default prompts a draft head is trained on: varied coding and prose instructions.

Written for this project (no external dataset is reachable where it trains), and disjoint from
the benchmark's prompts (bench/prompts; tests/test_eagle.py checks it). A user's own traffic
(`--prompts FILE`) trains a better head for that traffic.
"""

from __future__ import annotations

import itertools

_LANGUAGES = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "bash",
              "SQL"]
_CODE_TASKS = [
    "Write a {lang} function that checks whether a string is a palindrome, ignoring case and "
    "punctuation.",
    "Write a {lang} function that returns the n-th Fibonacci number iteratively.",
    "Implement binary search over a sorted array in {lang} and explain its complexity.",
    "Write {lang} code that counts how often each word appears in a text file.",
    "Show how to read a CSV file and compute the average of one column in {lang}.",
    "Write a {lang} function that flattens a nested list of integers.",
    "Implement a stack with push, pop and peek in {lang}, with a short usage example.",
    "Write a {lang} function that removes duplicate values from a list while keeping order.",
    "Write a {lang} program that prints the prime numbers below 100.",
    "Explain how error handling works in {lang} and show a small example.",
    "Write a {lang} function that converts a temperature from Celsius to Fahrenheit and back.",
    "Implement a function in {lang} that validates an email address with simple rules.",
    "Write a {lang} function that reverses the words of a sentence.",
    "Show a {lang} example of sorting records by two keys.",
    "Write unit tests in {lang} for a function that adds two numbers.",
    "Implement a queue using two stacks in {lang}.",
    "Write a {lang} function that computes the greatest common divisor of two integers.",
    "Show how to make an HTTP GET request and parse a JSON response in {lang}.",
    "Write a {lang} function that groups a list of strings by their first letter.",
    "Implement matrix multiplication for two small matrices in {lang}.",
]
_EDITS = [
    ("Add type hints and a docstring to this function:\n\n"
     "def scale(points, factor):\n    out = []\n    for x, y in points:\n"
     "        out.append((x * factor, y * factor))\n    return out\n"),
    ("Refactor this loop into a list comprehension and keep the behaviour:\n\n"
     "squares = []\nfor n in range(20):\n    if n % 3 == 0:\n        squares.append(n * n)\n"),
    ("Find the bug in this function and return a fixed version:\n\n"
     "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
     "    return total / len(xs) + 1\n"),
    ("Rewrite this function so that it does not modify its argument:\n\n"
     "def normalize(weights):\n    s = sum(weights)\n    for i in range(len(weights)):\n"
     "        weights[i] /= s\n    return weights\n"),
    ("Convert this callback-style JavaScript to async/await:\n\n"
     "function load(url, done) {\n  fetch(url).then(r => r.json()).then(data => done(null, "
     "data)).catch(err => done(err));\n}\n"),
    ("Add input validation to this function and raise ValueError on bad input:\n\n"
     "def make_range(start, stop, step):\n    return list(range(start, stop, step))\n"),
    ("Rename the function `calc` to `total_price` and its argument `l` to `items`:\n\n"
     "def calc(l):\n    t = 0\n    for item in l:\n        t += item['price'] * item['qty']\n"
     "    return t\n"),
    ("Make this class a dataclass and keep its methods:\n\n"
     "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
     "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"),
]
_TOPICS = ["photosynthesis", "the water cycle", "how vaccines work", "the French Revolution",
           "compound interest", "plate tectonics", "how a compiler works", "black holes",
           "the history of the printing press", "how neural networks learn",
           "supply and demand", "the immune system", "climate change", "the Roman Empire",
           "how the internet routes packets", "renewable energy", "the theory of evolution",
           "public key cryptography", "how airplanes fly", "the causes of inflation"]
_PROSE_TASKS = [
    "Explain {topic} to a curious twelve-year-old.",
    "Write a short summary of {topic} in three paragraphs.",
    "List five surprising facts about {topic}.",
    "Write a short blog post introducing {topic} to beginners.",
    "What are common misconceptions about {topic}? Correct them briefly.",
    "Write an outline for a lecture on {topic}.",
]
_WRITING = [
    "Write a polite email asking a colleague to review a pull request by Friday.",
    "Write a short story about a robot that learns to paint.",
    "Draft a cover letter for a junior software engineer position.",
    "Write a haiku about autumn rain, then explain its imagery.",
    "Give me a weekly meal plan for a vegetarian on a budget.",
    "Write release notes for a small library that added retries and fixed a memory leak.",
    "Compare working from home and working in an office in a balanced way.",
    "Write a product description for a reusable water bottle.",
    "Summarize the pros and cons of microservices versus a monolith.",
    "Write a friendly reminder message for a team meeting tomorrow at ten.",
    "Explain the difference between a process and a thread.",
    "Describe how to prepare for a technical interview in two weeks.",
]


def default_prompts() -> list[list[dict]]:
    """Chat conversations (one user turn each), in a fixed interleaved order."""
    code = [t.format(lang=lang) for t, lang in itertools.product(_CODE_TASKS, _LANGUAGES)]
    prose = [t.format(topic=topic) for t, topic in itertools.product(_PROSE_TASKS, _TOPICS)]
    groups = [code, prose, list(_EDITS) + list(_WRITING)]
    ordered = [p for row in itertools.zip_longest(*groups) for p in row if p is not None]
    return [[{"role": "user", "content": p}] for p in ordered]
