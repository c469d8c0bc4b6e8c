"""OpenAI response bodies, one renderer per endpoint: chat completions and (text) completions.

A renderer says what differs between the endpoints' output: the choices of the streamed chunks,
the logprobs format and the choices of the final body; the envelope (id, object, created, model)
and usage are shared. The generation flow (server.generation) is the same for both. Must not
touch the engine nor the event loop: it formats what it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.protocol import ChatCompletionRequest, CompletionRequest, now
from server.tools import ToolCallParser

if TYPE_CHECKING:
    from server.generation import ChoiceState


def envelope(object_: str, completion_id: str, model: str, choices: list[dict],
             **extra) -> dict:
    """What every body and every chunk of both endpoints starts with."""
    return {"id": completion_id, "object": object_, "created": now(), "model": model,
            "system_fingerprint": None, "choices": choices, **extra}


def usage(prompt_len: int, choices: list[ChoiceState]) -> dict:
    completion = sum(c.num_tokens for c in choices)
    body = {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": max(c.num_cached_tokens for c in choices)}}
    drafted = sum(c.drafted for c in choices)
    if drafted:
        methods: dict[str, dict[str, int]] = {}
        for c in choices:
            for method, (d, a) in c.spec_methods.items():
                m = methods.setdefault(method, {"drafted_tokens": 0, "accepted_tokens": 0})
                m["drafted_tokens"] += d
                m["accepted_tokens"] += a
        body["speculative"] = {"drafted_tokens": drafted,
                               "accepted_tokens": sum(c.accepted for c in choices),
                               "methods": methods}
    return body


class Renderer:
    """One endpoint's output format. Entries are (token id, (logprob, [(id, logprob), ...]))."""

    id_prefix = ""  # of the completion id
    object = ""  # of the non-streamed body
    chunk_object = ""  # of each streamed chunk

    def __init__(self, tokenizer, with_logprobs: bool) -> None:
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs

    def opening(self, choices: list[ChoiceState]) -> list[dict]:
        """Choices sent before any token, one chunk each."""
        return []

    def stream_choices(self, choice: ChoiceState, text: str, entries: list) -> list[dict]:
        """Choices for one engine output of `choice` (its released text and new tokens' logprob
        entries), one chunk each."""
        raise NotImplementedError

    def final_choice(self, choice: ChoiceState) -> dict:
        raise NotImplementedError

    def body(self, completion_id: str, model: str, choices: list[ChoiceState],
             usage_body: dict) -> dict:
        return envelope(self.object, completion_id, model,
                        [self.final_choice(c) for c in choices], usage=usage_body)

    def chunk(self, completion_id: str, model: str, choices: list[dict], **extra) -> dict:
        return envelope(self.chunk_object, completion_id, model, choices, **extra)


class ChatRenderer(Renderer):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, with_logprobs: bool, tool_names: set[str] | None = None):
        super().__init__(tokenizer, with_logprobs)
        self.tool_names = tool_names  # offered tools: the answer may hold calls
        self._parsers: dict[int, ToolCallParser] = {}  # per streamed choice

    @classmethod
    def for_request(cls, tokenizer, req: ChatCompletionRequest) -> ChatRenderer:
        offered = req.tools and req.tool_mode != "none"
        return cls(tokenizer, req.logprobs,
                   {t.function.name for t in req.tools} if offered else None)

    def opening(self, choices: list[ChoiceState]) -> list[dict]:  # the role, once, first
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for c in choices]

    def stream_choices(self, choice: ChoiceState, text: str, entries: list) -> list[dict]:
        out, calls, first, finish = [], [], 0, choice.finish_reason
        if self.tool_names is not None:
            parser = self._parsers.setdefault(choice.index, ToolCallParser(self.tool_names))
            first = len(parser.calls)
            text, calls = parser.feed(text, final=choice.done)
            finish = _finish(choice.finish_reason, parser.calls)
        if text or entries:
            out.append({"index": choice.index, "delta": {"content": text},
                        "logprobs": self.logprobs(entries), "finish_reason": None})
        for k, call in enumerate(calls):  # each call whole, once its closing tag arrived
            out.append({"index": choice.index, "delta": {"tool_calls": [
                {"index": first + k, **call}]}, "logprobs": None, "finish_reason": None})
        if choice.done:  # the finish reason comes in a chunk of its own, with an empty delta
            out.append({"index": choice.index, "delta": {}, "logprobs": None,
                        "finish_reason": finish})
        return out

    def final_choice(self, choice: ChoiceState) -> dict:
        message = {"role": "assistant", "content": choice.text}
        finish = choice.finish_reason
        if self.tool_names is not None:
            content, calls = ToolCallParser(self.tool_names).feed(choice.text, final=True)
            message["content"] = content if content.strip() or not calls else None
            if calls:
                message["tool_calls"] = calls
            finish = _finish(finish, calls)
        return {"index": choice.index, "message": message,
                "logprobs": self.logprobs(choice.entries), "finish_reason": finish}

    def logprobs(self, entries: list) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [{**self._token(tok, chosen),
                             "top_logprobs": [self._token(t, lp) for t, lp in top]}
                            for tok, (chosen, top) in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _finish(reason: str | None, calls: list) -> str | None:
    """A choice that ended by itself after calling tools finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


class CompletionRenderer(Renderer):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    @classmethod
    def for_request(cls, tokenizer, req: CompletionRequest) -> CompletionRenderer:
        return cls(tokenizer, req.logprobs is not None)

    def stream_choices(self, choice: ChoiceState, text: str, entries: list) -> list[dict]:
        if not (text or choice.done):
            return []
        offset = len(choice.text) - len(text)  # where this text starts in the choice's text
        return [{"index": choice.index, "text": text, "logprobs": self.logprobs(entries, offset),
                 "finish_reason": choice.finish_reason}]

    def final_choice(self, choice: ChoiceState) -> dict:
        return {"index": choice.index, "text": choice.text,
                "logprobs": self.logprobs(choice.entries, 0),
                "finish_reason": choice.finish_reason}

    def logprobs(self, entries: list, text_offset: int) -> dict | None:
        if not self.with_logprobs:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, (chosen, top) in entries:
            text = self.tokenizer.decode([tok])
            tokens.append(text)
            token_lps.append(chosen)
            tops.append({self.tokenizer.decode([t]): lp for t, lp in top})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}
