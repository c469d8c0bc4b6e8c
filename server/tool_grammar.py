"""The grammars of tool calls: what `tool_choice` lets the model write. Must not touch the engine
(it hands llguidance grammars to `SamplingParams`) nor parse answers (server.tool_parser does).

- `forced_grammar` (`required`, a named function): one `<tool_call>` block, or several with
  `parallel_tool_calls`, then the end of the turn.
- `auto_grammar` (`auto`): free text, or calls. The choice is made at the first bytes that only a
  call can have: a reply that starts with `{"name": "<offered function>"` (bare, in a list, or in
  a ```` ```json ```` fence) is a call to its end, and so is anything from a `<tool_call>` tag
  on (or Mistral's `[TOOL_CALLS]` token where the tokenizer has it). Free text cannot contain
  those starts, so a reply is never half a call: every call parses and its arguments follow
  its function's `parameters`, and the turn ends after the calls.

Arguments are written as response_format's JSON is (engine/structured.py: compact, Python's
separators); the few bytes around them (`{"name": ..., "arguments": ` and the closing brace)
may carry a little whitespace, as models write them pretty-printed in fences. Regexes here are
shared with the parser (server.tools), so what the grammar calls free text never parses as a
call.
"""

from __future__ import annotations

import json

from server import tools

# tool arguments are written as response_format's JSON is (engine/structured.py)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
WS = tools.WS


def forced_grammar(tokenizer, offered: list[dict], name: str | None, parallel: bool) -> str:
    """The grammar of one tool call (of `name`, else of any offered tool), or of one or more
    calls with `parallel`, as `<tool_call>` blocks; then the end."""
    from engine import structured

    functions = [t["function"] for t in offered if name is None or t["function"]["name"] == name]
    return structured.lark(f"start: tag_calls\n{_calls_rules(tokenizer, functions, parallel)}")


def auto_grammar(tokenizer, offered: list[dict], parallel: bool) -> str:
    """Free text, or tool calls of the offered functions (see the module docstring)."""
    from engine import structured

    functions = [t["function"] for t in offered]
    names = [f["name"] for f in functions]
    open_tag = _tag(tokenizer, tools.OPEN)
    forms = ["FREE", "json_form", "FREE? tag_calls" if _is_special(tokenizer, tools.OPEN)
             else "lead_tag tag_rest"]
    rules = [f"FREE: /(?s:.*)/ & ~/(?s:.*){tools.OPEN}(?s:.*)/ & "
             f"~/{tools.json_call_start(names)}(?s:.*)/",
             *_json_reply_rules(functions, parallel),
             # a tag that is text (no such token): text up to the first tag, then the calls
             f"lead_tag[lazy]: LEAD_TAG",
             f"LEAD_TAG: /(?s:.*){tools.OPEN}/ & ~/{tools.json_call_start(names)}(?s:.*)/",
             f"tag_rest: call_body (\"\\n\" {open_tag} call_body)*" + ' "\\n"?' if parallel
             else 'tag_rest: call_body "\\n"?']
    mistral = tools.mistral_token_id(tokenizer)
    if mistral is not None:
        forms.append(f"FREE? <[{mistral}]> \" \"? json_calls")
    return structured.lark(f"start: {' | '.join(forms)}\n" + "\n".join(rules) + "\n"
                           + _calls_rules(tokenizer, functions, parallel))


def _json_reply_rules(functions: list[dict], parallel: bool) -> list[str]:
    """Rule `json_form`: a reply that is a JSON call or list of calls, bare or fenced, with a
    little whitespace around the call objects' keys (`WS`).

    Its first call's opening bytes, up to the function's name and beyond, are one lexeme with
    whatever comes before (whitespace, fence, bracket): llguidance's lexer takes the longest
    match, so a lexeme that ended (a fence alone) while free text still matched would lose."""
    leads = {"bare": "", "list": rf"\[{WS}", "fenced": rf"{tools.FENCE}{WS}",
             "fenced_list": rf"{tools.FENCE}{WS}\[{WS}"}
    rest = "(LIST_SEP flex_call)* LIST_CLOSE" if parallel else "LIST_CLOSE"
    rules = ["json_form: first_bare | first_list list_rest | first_fenced CLOSE_FENCE"
             " | first_fenced_list list_rest CLOSE_FENCE",
             f"list_rest: {rest}", f"CLOSE_FENCE: /{WS}```/", f"LIST_SEP: /{WS},{WS}/",
             f"LIST_CLOSE: /{WS}\\]/", f"FLEX_CLOSE: /{WS}\\}}/",
             "flex_call: " + " | ".join(f"OPEN_{i} args_{i} FLEX_CLOSE"
                                        for i in range(len(functions)))]
    for form, lead in {"": "", **leads}.items():
        label = f"_{form.upper()}" if form else ""
        if form:
            rules.append(f"first_{form}: " + " | ".join(
                f"OPEN{label}_{i} args_{i} FLEX_CLOSE" for i in range(len(functions))))
        start = WS if form else ""  # only a reply's first call may follow whitespace
        rules += [f"OPEN{label}_{i}: /{start}{lead}{tools.json_call_head(fn['name'])}/"
                  for i, fn in enumerate(functions)]
    return rules


def _calls_rules(tokenizer, functions: list[dict], parallel: bool) -> str:
    """Rules `tag_calls` (`<tool_call>` blocks), `call_body` (one block after its open tag),
    `json_calls` (a JSON list of calls) and `json_call` (one call object), all written
    compactly, and `args_<i>` (the arguments of function i)."""
    open_tag, close_tag = _tag(tokenizer, tools.OPEN), _tag(tokenizer, tools.CLOSE)
    # a newline may follow the last block: models write one before they end the turn
    rules = [f"tag_calls: {open_tag} call_body" + (f" (\"\\n\" {open_tag} call_body)*"
                                                   if parallel else "") + ' "\\n"?',
             f"call_body: \"\\n\" json_call \"\\n\" {close_tag}",
             'json_calls: "[" json_call (", " json_call)* "]"' if parallel
             else 'json_calls: "[" json_call "]"',
             "json_call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        schema = {**_object_schema(fn), "x-guidance": JSON_STYLE}
        head = json.dumps({"name": fn["name"], "arguments": 0})[:-2]  # up to the arguments
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        rules.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
    return "\n".join(rules) + "\n"


def _object_schema(fn: dict) -> dict:
    """The function's `parameters`: arguments are a JSON object, whatever else they are."""
    schema = dict(fn.get("parameters") or {})
    if schema.setdefault("type", "object") != "object":
        raise ValueError(f"function {fn['name']!r}: parameters must be an object schema")
    return schema


def _is_special(tokenizer, tag: str) -> bool:
    """Whether `tag` is one token of its own (Qwen2.5's `<tool_call>`), which a grammar names
    as `<tag>`; otherwise it is text."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return tag in added


def _tag(tokenizer, tag: str) -> str:
    return tag if _is_special(tokenizer, tag) else json.dumps(tag)
