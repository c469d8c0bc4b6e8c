"""Tool calling: tools in, `message.tool_calls` out. Must not touch the engine.

The one format on the wire between the model and us is Hermes' (Qwen2.5's own): a call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several may follow each other.

- In: a chat template that knows tools (it uses the `tools` variable, as Qwen2.5's does) gets
  them, with the history's assistant `tool_calls` and `tool` messages. A template that does not
  (SmolLM2-135M's) gets the same instructions in a system message, calls as assistant text and
  results as `<tool_response>` user turns: the model is told about the tools either way.
- Out: `ToolCallParser` splits the answer into content and calls, also incrementally for
  streaming (a call is released once its closing tag arrives; text that may still become a
  call is held back). A block that is not a valid call stays content.
- Enforced: `tool_choice: "required"` or a named function constrains decoding with a grammar
  of one call (or several with `parallel_tool_calls`) whose arguments follow the function's
  JSON schema, so the call always parses and validates. `auto` lets the model choose; `none`
  leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# tool arguments are written as response_format's JSON is (engine/structured.py)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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


def call_grammar(tokenizer, tools: list[dict], name: str | None, parallel: bool) -> str:
    """The grammar of one tool call (of `name`, else of any tool), or of one or more calls
    with `parallel`: the arguments follow the function's parameters schema."""
    from engine import structured

    variants = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        variants.append({"type": "object", "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": variants, "x-guidance": JSON_STYLE}
    special = OPEN in (tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab")
                       else {})
    open_, close = (OPEN, CLOSE) if special else (json.dumps(OPEN), json.dumps(CLOSE))
    call = f'{open_} "\\n" %json {json.dumps(schema)} "\\n" {close}'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return structured.lark(f"{start}\ncall: {call}\n")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Splits a model's answer into content and tool calls, as the text arrives."""

    def __init__(self, known: set[str]) -> None:
        self.known = known  # the request's function names: a call of another is content
        self.buffer = ""
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content released, calls completed) after `text`; `final` flushes what is held."""
        self.buffer += text
        content, calls = [], []
        while self.buffer:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content.append(self.buffer[:start])
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0 and not final:
                break  # a call still arriving
            body = self.buffer[len(OPEN):end if end >= 0 else None]
            block = self.buffer[:end + len(CLOSE)] if end >= 0 else self.buffer
            self.buffer = self.buffer[len(block):].lstrip("\n") if end >= 0 else ""
            call = self._call(body)
            if call is None:
                content.append(block)
            else:
                calls.append(call)
        self.calls += calls
        return "".join(content), calls

    def _call(self, body: str) -> dict | None:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return None
        if (not isinstance(data, dict) or data.get("name") not in self.known
                or not isinstance(data.get("arguments", {}), (dict, str))):
            return None
        args = data.get("arguments", {})
        return {"id": new_call_id(), "type": "function",
                "function": {"name": data["name"],
                             "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
