"""Tool calls without a model: parsing what models write (server/tool_parser.py), the grammars
of `auto` and forced calls (server/tool_grammar.py), prompt building (server/tools.py)."""

import json

import pytest

from conftest import build_tokenizer
from server import tool_grammar
from server.detokenizer import IncrementalDetokenizer
from server.tool_parser import ToolCallParser
from server.tools import CLOSE, MISTRAL, OPEN, template_messages

KNOWN = {"get_weather", "get_time"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
    "additionalProperties": False}}}


def call(name, **args):
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}"


def obj(name, **args):
    return json.dumps({"name": name, "arguments": args})


def parse(text, known=KNOWN, **kw):
    """(content, [(name, args)]) parsed whole, checked equal to the same text in 1-char
    pieces (a stream)."""
    whole = ToolCallParser(known, **kw).feed(text, final=True)
    parser = ToolCallParser(known, **kw)
    pieces = [parser.feed(ch) for ch in text] + [parser.feed("", final=True)]
    streamed = ("".join(c for c, _ in pieces), [k for _, calls in pieces for k in calls])
    assert streamed[0] == whole[0]
    assert [c["function"] for c in streamed[1]] == [c["function"] for c in whole[1]]
    return whole[0], [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in whole[1]]


def test_calls_and_content_are_split_whole_or_in_pieces():
    text = "Let me check." + call("get_weather", city="Paris") + "\n" + call("get_time") + " done"
    assert parse(text) == ("Let me check. done",
                           [("get_weather", {"city": "Paris"}), ("get_time", {})])
    # nothing that may still be a tag is released early
    parser = ToolCallParser({"f"})
    assert parser.feed("hello <tool_") == ("hello ", [])
    assert parser.feed("cal") == ("", [])
    assert parser.feed("x") == ("<tool_calx", [])


PARIS = [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text, calls", [
    (obj("get_weather", city="Paris"), PARIS),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', PARIS),  # Llama 3.1's key
    ("```json\n" + obj("get_weather", city="Paris") + "\n```", PARIS),
    ("\n```\n" + obj("get_weather", city="Paris") + "\n```\n", PARIS),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     PARIS),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', PARIS),  # a string
    ("[" + obj("get_weather", city="Paris") + ", " + obj("get_time", zone="UTC") + "]",
     PARIS + [("get_time", {"zone": "UTC"})]),
])
def test_a_reply_that_is_a_json_call_is_a_call(text, calls):
    assert parse(text) == ("", calls)


def test_mistral_calls_after_their_token():
    text = "Checking. " + MISTRAL + "[" + obj("get_weather", city="Paris") + "]"
    assert parse(text, mistral=True) == ("Checking. ", PARIS)
    assert parse(text) == (text, [])  # a tokenizer without the token: it is text


@pytest.mark.parametrize("text", [
    obj("get_sunshine", city="Paris"),  # no such tool
    '{"name": "get_weather", "arguments": ["Paris"]}',  # arguments not an object
    '{"name": "get_weather", "arguments": "Paris"}',  # a string that is not an object's JSON
    '{"name": "get_weather"}',  # no arguments
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # name is not first
    '{"name": "get_weather", "arguments": {}, "id": 3}',  # not just a call
    "You can call it so: " + obj("get_weather", city="Paris"),  # JSON inside prose
    obj("get_weather", city="Paris") + " is how you would call it.",
    "```python\n" + obj("get_weather", city="Paris") + "\n```",
    obj("get_weather", city="Paris") + "\n" + obj("get_time", zone="UTC"),  # two, not a list
    "[" + obj("get_weather", city="Paris") + ", " + obj("nope") + "]",  # one unknown
    '{"name": "Bob", "age": 3}',
])
def test_near_misses_stay_text(text):
    assert parse(text) == (text, [])


def test_a_block_that_is_not_a_call_stays_content():
    for body in ("not json", json.dumps({"name": "unknown", "arguments": {}}),
                 json.dumps(["f"])):
        text = f"{OPEN}\n{body}\n{CLOSE}"
        assert parse(text, {"f"}) == (text, [])
    # an unclosed call at the end of the answer (the model stopped right after it) still counts
    content, calls = parse(call("f", a="b")[:-len(CLOSE)], {"f"})
    assert content == "" and calls == [("f", {"a": "b"})]


def test_text_is_held_back_only_while_it_may_become_a_json_call():
    parser = ToolCallParser(KNOWN)
    assert parser.feed("Sure") == ("Sure", [])  # cannot start a call: released at once
    parser = ToolCallParser(KNOWN)
    assert parser.feed('```json\n{"name": "get_w') == ("", [])
    assert parser.feed('ind"') == ('```json\n{"name": "get_wind"', [])  # not a tool: text
    parser = ToolCallParser(KNOWN)
    assert parser.feed(obj("get_time", zone="UTC")) == ("", [])  # a call: held to the end
    content, calls = parser.feed("", final=True)
    assert content == "" and calls[0]["function"]["name"] == "get_time"


def test_a_repeated_call_or_a_second_one_without_parallel_ends_the_turn():
    paris, london = call("get_weather", city="Paris"), call("get_weather", city="London")
    parser = ToolCallParser(KNOWN)
    _, calls = parser.feed(paris + "\n" + london + "\n" + paris + "\n" + paris)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "London"]
    assert parser.ended and parser.feed("more", final=True) == ("", [])
    parser = ToolCallParser(KNOWN, parallel=False)
    _, calls = parser.feed(paris + "\n")
    assert len(calls) == 1 and parser.ended
    assert parse("[" + obj("get_weather", city="Paris") + ", " + obj("get_time", zone="UTC")
                 + "]", parallel=False) == ("", PARIS)


# -- grammars ----------------------------------------------------------------------------------

def _tokenizers():
    """The test tokenizer, where the tags are text, and one where they are tokens of their own
    (as Qwen2.5's) with Mistral's [TOOL_CALLS] as a special token."""
    plain = build_tokenizer()
    tagged = build_tokenizer()
    tagged.add_tokens([OPEN, CLOSE])
    tagged.add_special_tokens({"additional_special_tokens": [MISTRAL]})
    return {"text tags": plain, "token tags": tagged}


TOKENIZERS = _tokenizers()
REPLIES = {
    "text": "It is sunny.", "other json": '{"name": "Bob", "age": 3}',
    "bare": obj("get_weather", city="Paris"),
    "fenced pretty": '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}'
                     '\n```',
    "list": "[" + obj("get_weather", city="Paris") + ", " + obj("get_time", zone="UTC") + "]",
    "tag": call("get_time", zone="UTC"),
    "text then tag": "Let me see.\n" + call("get_time", zone="UTC"),
    "two tags": call("get_weather", city="Paris") + "\n" + call("get_time", zone="UTC"),
    "bad arguments": obj("get_weather", town="Paris"),
    "half a call": '{"name": "get_weather"}',
    "tag then text": call("get_time", zone="UTC") + " done",
    "bad tag arguments": call("get_weather", city=3),
}


def accepts(tok, grammar, text) -> bool:
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_grammar_allows_text_or_whole_valid_calls(kind, parallel):
    tok = TOKENIZERS[kind]
    grammar = tool_grammar.auto_grammar(tok, [WEATHER, TIME], parallel)
    allowed = {name for name, text in REPLIES.items() if accepts(tok, grammar, text)}
    single = {"text", "other json", "bare", "fenced pretty", "tag", "text then tag"}
    assert allowed == (single | {"list", "two tags"} if parallel else single)
    for name in allowed:  # what the grammar calls text never parses as a call, and vice versa
        content, calls = parse(REPLIES[name], parallel=parallel)
        assert bool(calls) == (name not in ("text", "other json")), name


def test_mistral_token_in_the_auto_grammar():
    tok = TOKENIZERS["token tags"]
    grammar = tool_grammar.auto_grammar(tok, [WEATHER], True)
    assert accepts(tok, grammar, "Sure. " + MISTRAL + "[" + obj("get_weather", city="Oslo") + "]")
    assert not accepts(tok, grammar, MISTRAL + "[" + obj("get_weather", town="Oslo") + "]")


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_forced_grammar_is_calls_only(kind):
    tok = TOKENIZERS[kind]
    grammar = tool_grammar.forced_grammar(tok, [WEATHER, TIME], None, True)
    allowed = {name for name, text in REPLIES.items() if accepts(tok, grammar, text)}
    assert allowed == {"tag", "two tags"}
    named = tool_grammar.forced_grammar(tok, [WEATHER, TIME], "get_weather", False)
    assert accepts(tok, named, call("get_weather", city="Rome"))
    assert not accepts(tok, named, call("get_time", zone="UTC"))
    assert not accepts(tok, named, call("get_weather", city="Rome") + "\n"
                       + call("get_weather", city="Oslo"))


def test_parameters_must_be_an_object_schema():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(ValueError, match="object schema"):
        tool_grammar.auto_grammar(TOKENIZERS["text tags"], [bad], True)


def test_the_detokenizer_keeps_the_mistral_token():
    tok = TOKENIZERS["token tags"]
    marker = tok.convert_tokens_to_ids(MISTRAL)
    ids = tok.encode("ab", add_special_tokens=False) + [marker] + tok.encode(
        "[1]", add_special_tokens=False)
    assert IncrementalDetokenizer(tok).add(ids) == "ab[1]"
    assert IncrementalDetokenizer(tok, keep=frozenset({marker})).add(ids) == "ab" + MISTRAL + "[1]"


def test_a_template_without_tools_gets_them_as_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    messages, passed = template_messages(history, tools, native=False)
    assert passed is None
    assert messages[0]["role"] == "system" and '"name": "f"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": call("f", a=1)}
    assert messages[3]["role"] == "user" and "<tool_response>\n42\n" in messages[3]["content"]
    native, passed = template_messages(history, tools, native=True)
    assert passed == tools and native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
