"""The default prompts a draft head is trained on: varied coding and prose instructions,
follow-up second turns, and tool turns (a conversation with `tools`: a question the target
answers with a tool call, or a tool's result it answers from).

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


# Second turns: the first answer is a short one written here (the target's own first answer
# would cost a generation), and the target answers the follow-up.
_FIRST_ANSWERS = {
    "code": "Here is a straightforward {lang} version with the main loop kept simple. It "
            "handles the common cases; tell me if you need more.",
    "prose": "In short: {topic} is a broad subject, and the key ideas fit in a few paragraphs. "
             "Tell me which part you want in more depth.",
}
_FOLLOW_UPS_CODE = [
    "Now add unit tests for it.",
    "Can you make it handle empty input and explain the edge cases?",
    "Rewrite it to be more idiomatic and add comments.",
    "What is its time and memory complexity? Can it be improved?",
]
_FOLLOW_UPS_PROSE = [
    "Make it shorter, in five bullet points.",
    "Go deeper into the most important part.",
    "Give me three questions to check that I understood it, with answers.",
]
# Tool turns in the form the server renders them (OpenAI `tools`, through the chat template):
# the target answers with a tool call, or with a tool's result in the conversation.
_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string",
                                                  "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the project's documentation.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_sql", "description": "Run a read-only SQL query on the sales database.",
        "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                       "required": ["sql"]}}},
]
_TOOL_ASKS = [
    "What's the weather like in {city} right now?",
    "Is it warmer in {city} or in Oslo today? Use fahrenheit.",
    "Find the documentation about configuring retries for {city}'s deployment.",
    "How many orders did we ship to {city} last month? Query the database.",
]
_CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Krakow"]
_TOOL_RESULTS = [
    ("get_weather", {"city": "Lisbon"}, '{"temperature": 19, "unit": "celsius", '
                                        '"conditions": "light rain"}'),
    ("search_docs", {"query": "retry policy"}, '[{"title": "Retries", "text": "Set '
                                               'max_retries and backoff in client.yaml."}]'),
    ("run_sql", {"sql": "SELECT count(*) FROM orders WHERE city = \'Lima\'"},
     '[{"count": 1284}]'),
]


def _multi_turn() -> list[list[dict]]:
    out = []
    for (task, lang), follow in zip(itertools.product(_CODE_TASKS[:12], _LANGUAGES[:4]),
                                    itertools.cycle(_FOLLOW_UPS_CODE)):
        out.append([{"role": "user", "content": task.format(lang=lang)},
                    {"role": "assistant", "content": _FIRST_ANSWERS["code"].format(lang=lang)},
                    {"role": "user", "content": follow}])
    for (task, topic), follow in zip(itertools.product(_PROSE_TASKS[:3], _TOPICS[:8]),
                                     itertools.cycle(_FOLLOW_UPS_PROSE)):
        out.append([{"role": "user", "content": task.format(topic=topic)},
                    {"role": "assistant", "content": _FIRST_ANSWERS["prose"].format(
                        topic=topic)},
                    {"role": "user", "content": follow}])
    return out


def _tool_turns() -> list[dict]:
    """Conversations with `tools`: a question the target answers with a call, and a tool's
    result the target turns into an answer."""
    out = [{"messages": [{"role": "user", "content": ask.format(city=city)}], "tools": _TOOLS}
           for ask, city in itertools.product(_TOOL_ASKS, _CITIES)]
    for i, (name, args, result) in enumerate(_TOOL_RESULTS):
        ask = {"get_weather": "What's the weather in Lisbon?",
               "search_docs": "How do I configure retries?",
               "run_sql": "How many orders went to Lima?"}[name]
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": name, "arguments": args}}
        out.append({"messages": [{"role": "user", "content": ask},
                                 {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": f"call_{i}",
                                  "content": result}], "tools": _TOOLS})
    return out


def default_prompts() -> list[list[dict] | dict]:
    """Chat conversations in a fixed interleaved order: one user turn (coding, prose,
    edits, writing), follow-up second turns, and tool turns (dicts with `messages` and
    `tools`, rendered through the chat template as the server renders a request's tools)."""
    code = [t.format(lang=lang) for t, lang in itertools.product(_CODE_TASKS, _LANGUAGES)]
    prose = [t.format(topic=topic) for t, topic in itertools.product(_PROSE_TASKS, _TOPICS)]
    single = [[{"role": "user", "content": p}] for p in list(_EDITS) + list(_WRITING)]
    groups = [[[{"role": "user", "content": p}] for p in code],
              [[{"role": "user", "content": p}] for p in prose],
              single + _multi_turn(), _tool_turns()]
    return [p for row in itertools.zip_longest(*groups) for p in row if p is not None]
