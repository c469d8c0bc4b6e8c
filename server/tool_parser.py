"""Tool calls out of a model's answer, as the text arrives. Must not touch the engine nor format
responses (server.renderers does).

Recognised, for the request's functions only (server.tools has the formats' regexes):
- Hermes / Qwen2.5 `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks,
  after any content;
- a reply that is only a JSON call object `{"name", "arguments"}` (or `"parameters"`, Llama
  3.1's key), or a list of them, bare or in a ```` ``` ```` / ```` ```json ```` fence;
- Mistral's `[TOOL_CALLS]` followed by such a list, after any content, where the tokenizer has
  that token.
A call names an offered function first and has arguments that are an object (or a JSON string
of one); anything else stays content, and so does JSON inside a longer answer.

The parser is also the turn's stop rule: a call identical to an earlier one, or a second call
without `parallel_tool_calls`, ends the turn (`ended`) and is dropped.
"""

from __future__ import annotations

import json

import regex

from server import tools


class ToolCallParser:
    """Splits a model's answer into content and tool calls, as the text arrives."""

    def __init__(self, known: set[str], parallel: bool = True, mistral: bool = False) -> None:
        self.known = known  # the request's function names: a call of another is content
        self.parallel = parallel
        self.markers = [tools.OPEN] + ([tools.MISTRAL] if mistral else [])
        self._json_start = regex.compile(tools.json_call_start(sorted(known)))
        self.mode = "start"  # start: may still be a JSON reply | json: is one | text | after
        self.buffer = ""
        self.calls: list[dict] = []
        self.ended = False  # the turn is over: what follows is dropped
        self._after_block = False  # newlines after a call block separate calls: not content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content released, calls completed) after `text`; `final` flushes what is held."""
        if self.ended:
            return "", []
        self.buffer += text
        if self._after_block:
            self.buffer = self.buffer.lstrip("\n")
            self._after_block = not self.buffer
        first = len(self.calls)
        content = self._advance(final)
        return content, self.calls[first:]

    def _advance(self, final: bool) -> str:
        if self.mode == "start":
            match = self._json_start.match(self.buffer, partial=True)
            if match is not None and match.partial and not final:
                return ""  # it may still become a JSON call
            self.mode = "json" if match is not None and not match.partial else "text"
        if self.mode == "json":
            return self._json_reply(final)
        content = []
        while self.buffer and not self.ended and self.mode == "text":
            content.append(self._text_until_marker(final))
            if self.buffer.startswith(tools.OPEN):
                if tools.CLOSE not in self.buffer and not final:
                    break  # a call still arriving
                content.append(self._tag_block())
            elif self.buffer.startswith(tools.MISTRAL):
                self.mode = "after"  # the rest of the reply is the list of calls
            else:
                break
        if self.mode == "after" and final:
            calls = parse_json_calls(self.buffer[len(tools.MISTRAL):], self.known)
            content.append(self._accept(calls) if calls else self.buffer)
            self.buffer = ""
        return "".join(content)

    def _text_until_marker(self, final: bool) -> str:
        """Releases the text before the next marker (all of it, but a tail that may still
        become a marker, if there is none)."""
        starts = [i for i in (self.buffer.find(m) for m in self.markers) if i >= 0]
        cut = min(starts) if starts else len(self.buffer) - (
            0 if final else max(_partial_suffix(self.buffer, m) for m in self.markers))
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return text

    def _tag_block(self) -> str:
        """The `<tool_call>` block at the buffer's start (to its end if unclosed): accepted as
        a call, or given back as content."""
        end = self.buffer.find(tools.CLOSE)
        body = self.buffer[len(tools.OPEN):end if end >= 0 else None]
        block = self.buffer[:end + len(tools.CLOSE)] if end >= 0 else self.buffer
        self.buffer = self.buffer[len(block):].lstrip("\n")
        self._after_block = not self.buffer
        call = parse_call(body, self.known, bare=False)
        if call is None:
            return block
        return self._accept([call])

    def _json_reply(self, final: bool) -> str:
        if not final:
            return ""
        text, self.buffer = self.buffer, ""
        calls = parse_json_calls(text, self.known)
        return self._accept(calls) if calls else text

    def _accept(self, calls: list[dict]) -> str:
        """Takes calls in order until the turn ends; returns "" (calls are not content)."""
        for call in calls:
            if any(_same(call, c) for c in self.calls) or (self.calls and not self.parallel):
                self.ended = True
            else:
                self.calls.append(call)
                self.ended = not self.parallel
            if self.ended:
                self.buffer = ""
                break
        return ""


def parse_json_calls(text: str, known: set[str]) -> list[dict] | None:
    """The calls of a reply that is only a JSON call object or list (bare or fenced), or None."""
    text = text.strip()
    if text.startswith("```"):
        first_line, _, rest = text.partition("\n")
        if first_line.strip() not in ("```", "```json") or not rest.rstrip().endswith("```"):
            return None
        text = rest.rstrip()[:-3]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = [_call(item, known, bare=True) for item in items]
    return calls if calls and None not in calls else None


def parse_call(body: str, known: set[str], bare: bool) -> dict | None:
    """The call that `body` (one JSON object) is, or None."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call(data, known, bare)


def _call(data, known: set[str], bare: bool) -> dict | None:
    """A call object: an offered function's `name` and its `arguments` (or `parameters`), an
    object or a JSON string of one. A `bare` one (not in a tag) has `name` first, as the
    grammar's, and its arguments given."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) \
            or data["name"] not in known:
        return None
    keys = set(data) - {"name"}
    if len(keys) > 1 or not keys <= {"arguments", "parameters"}:
        return None
    if bare and (not keys or next(iter(data)) != "name"):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": tools.new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(args)}}


def _same(a: dict, b: dict) -> bool:
    fa, fb = a["function"], b["function"]
    return fa["name"] == fb["name"] and json.loads(fa["arguments"]) == json.loads(fb["arguments"])


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def for_request(req, tokenizer) -> ToolCallParser | None:
    """The parser of a chat request that offers tools, else None."""
    offered = getattr(req, "tools", None)
    if not offered or req.tool_mode == "none":
        return None
    return ToolCallParser({t.function.name for t in offered}, req.parallel_tool_calls,
                          mistral=tools.mistral_token_id(tokenizer) is not None)


def kept_tokens(tokenizer) -> frozenset[int]:
    """Special tokens the parser must see in the text: Mistral's `[TOOL_CALLS]`."""
    mistral = tools.mistral_token_id(tokenizer)
    return frozenset() if mistral is None else frozenset({mistral})
