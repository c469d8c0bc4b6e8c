"""Tool calling, the prompt side and the formats of calls. Must not touch the engine.

The format we teach the model is Hermes' (Qwen2.5's own): a call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several may follow each other.
Models also write calls as a bare or fenced JSON object or list, and Mistral's templates after a
`[TOOL_CALLS]` token: the regexes here say where such a call starts, for the parser
(server.tool_parser) and the grammars (server.tool_grammar) alike.

- In: a chat template that knows tools (it uses the `tools` variable, as Qwen2.5's does) gets
  them, with the history's assistant `tool_calls` and `tool` messages. A template that does not
  (SmolLM2-135M's) gets the same instructions in a system message, calls as assistant text and
  results as `<tool_response>` user turns: the model is told about the tools either way.
- Out: server.tool_parser splits the answer into content and calls; server.tool_grammar
  constrains what the model may write under `required`, a named function and `auto`; `none`
  leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"  # Mistral's token before a JSON list of calls
# whitespace around the keys of a call object: a space, or a newline and an indent, as in
# pretty-printed JSON, never more (in regexes of both Python and llguidance; function names are
# [a-zA-Z0-9_-], never escaped)
WS = r"(?:\n[ \t]{0,8}| ?)"
FENCE = r"```(?:json)?[ \t]*\n"  # a Markdown code fence's opening line


def json_call_start(names: list[str]) -> str:
    """Regex of the start of a reply that can only be a JSON call of one of `names`: optional
    whitespace and fence, optional list bracket, then `{"name": "<name>"`."""
    fence = rf"(?:{FENCE}{WS})?"
    return (rf'{WS}{fence}(?:\[{WS})?\{{{WS}"name"{WS}:{WS}"(?:{"|".join(names)})"')


def json_call_head(name: str) -> str:
    """Regex of a call object's bytes before its arguments."""
    return (rf'\{{{WS}"name"{WS}:{WS}"{name}"{WS},{WS}"(?:arguments|parameters)"{WS}:{WS}')


def mistral_token_id(tokenizer) -> int | None:
    """The id of `[TOOL_CALLS]` where the tokenizer has it as a token of its own."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return added.get(MISTRAL)


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def call_text(name: str, arguments: dict | str) -> str:
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def system_prompt(tools: list[dict]) -> str:
    """The tool instructions for a template that has none (the wording of Qwen2.5's)."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            f"{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")


def template_messages(messages: list[dict], tools: list[dict] | None,
                      native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `apply_chat_template`. messages are OpenAI dicts (assistant
    `tool_calls` with JSON-string arguments, `tool` results); `native`: the template knows
    tools."""
    if native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "content": m.get("content") or "", "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _arguments(c)}}
                    for c in m["tool_calls"]]}
            out.append(m)
        return out, tools
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], _arguments(c))
                              for c in m["tool_calls"])
            out.append({"role": "assistant",
                        "content": "\n".join(filter(None, [m.get("content"), calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _arguments(call: dict) -> dict:
    args = call["function"].get("arguments") or "{}"
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        raise ValueError(f"tool call {call['function']['name']!r}: arguments are not JSON")
    if not isinstance(parsed, dict):
        raise ValueError(f"tool call {call['function']['name']!r}: arguments must be an object")
    return parsed


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
