"""Tool-call parsing and prompt building (server/tools.py), without a model."""

import json

from server.tools import CLOSE, OPEN, ToolCallParser, template_messages


def call(name, **args):
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}"


def test_calls_and_content_are_split_whole_or_in_pieces():
    text = "Let me check." + call("f", x=1) + "\n" + call("g") + " done"
    whole = ToolCallParser({"f", "g"}).feed(text, final=True)
    parser = ToolCallParser({"f", "g"})
    pieces = [parser.feed(text[i:i + 3]) for i in range(0, len(text), 3)]
    pieces.append(parser.feed("", final=True))
    streamed = ("".join(c for c, _ in pieces), [k for _, calls in pieces for k in calls])
    for content, calls in (whole, streamed):
        assert content == "Let me check. done"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == [("f", {"x": 1}), ("g", {})]
    # nothing that may still be a tag is released early
    parser = ToolCallParser({"f"})
    assert parser.feed("hello <tool_") == ("hello ", [])
    assert parser.feed("cal") == ("", [])
    assert parser.feed("x") == ("<tool_calx", [])


def test_a_block_that_is_not_a_call_stays_content():
    for body in ("not json", json.dumps({"name": "unknown", "arguments": {}}),
                 json.dumps(["f"])):
        text = f"{OPEN}\n{body}\n{CLOSE}"
        assert ToolCallParser({"f"}).feed(text, final=True) == (text, [])
    # an unclosed call at the end of the answer (the model stopped right after it) still counts
    content, calls = ToolCallParser({"f"}).feed(call("f", a="b")[:-len(CLOSE)], final=True)
    assert content == "" and calls[0]["function"]["name"] == "f"


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
