"""OpenAI response bodies, one renderer per endpoint: chat completions and (text) completions.

A renderer says what differs between the endpoints' output: the choices of the streamed chunks,
the logprobs format and the choices of the final body; the envelope (id, object, created, model)
and usage are shared. The generation flow (server.generation) is the same for both. Must not
touch the engine nor the event loop: it formats what it is given.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from engine.spec_decode.prediction import predicted_tokens
from server.errors import APIError, error_body
from server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now

if TYPE_CHECKING:
    from server.generation import ChoiceState, Generation

log = logging.getLogger("specserve.server")


def envelope(object_: str, completion_id: str, model: str, choices: list[dict],
             **extra) -> dict:
    """What every body and every chunk of both endpoints starts with."""
    return {"id": completion_id, "object": object_, "created": now(), "model": model,
            "system_fingerprint": None, "choices": choices, **extra}


def usage(prompt_len: int, choices: list[ChoiceState],
          prediction: list[int] | None = None) -> dict:
    completion = sum(c.num_tokens for c in choices)
    body = {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": max(c.num_cached_tokens for c in choices)}}
    if prediction is not None:  # OpenAI's Predicted Outputs counts, summed over the choices
        accepted = [predicted_tokens(prediction, c.token_ids) for c in choices]
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(accepted),
            "rejected_prediction_tokens": sum(len(prediction) - a for a in accepted)}
    drafted = sum(c.drafted for c in choices)
    if drafted:
        methods: dict[str, dict[str, int]] = {}
        trees = [0, 0]  # token-tree verifications, their nodes (drafted tokens)
        for c in choices:
            for method, (d, a, tv, tn) in c.spec_methods.items():
                m = methods.setdefault(method, {"drafted_tokens": 0, "accepted_tokens": 0})
                m["drafted_tokens"] += d
                m["accepted_tokens"] += a
                if tv:
                    m["tree_verifications"] = m.get("tree_verifications", 0) + tv
                    m["tree_drafted_tokens"] = m.get("tree_drafted_tokens", 0) + tn
                    trees[0] += tv
                    trees[1] += tn
        body["speculative"] = {"drafted_tokens": drafted,
                               "accepted_tokens": sum(c.accepted for c in choices),
                               "methods": methods}
        if trees[0]:  # drafts verified as token trees: how many, and their nodes
            body["speculative"]["tree_verifications"] = trees[0]
            body["speculative"]["tree_drafted_tokens"] = trees[1]
    return body


class Renderer:
    """One endpoint's output format: the streamed events and the non-streamed body of a
    generation (server.generation.Generation: its id, choices and usage). Entries are
    (token id, (logprob, [(id, logprob), ...]))."""

    id_prefix = ""  # of the completion id

    def new_id(self) -> str:
        return new_id(self.id_prefix)

    def opening(self, gen: Generation) -> list[dict]:
        """SSE events before any token."""
        return []

    def stream_events(self, gen: Generation, choice: ChoiceState, text: str,
                      entries: list) -> list[dict]:
        """SSE events for one engine output of `choice` (its released text and new tokens'
        logprob entries)."""
        raise NotImplementedError

    def closing(self, gen: Generation) -> list[dict]:
        """SSE events once every choice is done."""
        return []

    def failed(self, gen: Generation, exc: Exception) -> list[dict]:
        """SSE events that end a stream the engine or the server failed."""
        raise NotImplementedError

    def body(self, gen: Generation) -> dict:
        """The non-streamed answer."""
        raise NotImplementedError


class ChunkRenderer(Renderer):
    """Chat and completions: a stream of chunks of the body's shape, one choice each, then the
    usage if asked for, then [DONE]."""

    object = ""  # of the non-streamed body
    chunk_object = ""  # of each streamed chunk

    def __init__(self, tokenizer, with_logprobs: bool) -> None:
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs

    def opening_choices(self, choices: list[ChoiceState]) -> list[dict]:
        """Choices sent before any token, one chunk each."""
        return []

    def stream_choices(self, choice: ChoiceState, text: str, entries: list) -> list[dict]:
        """Choices for one engine output of `choice`, one chunk each."""
        raise NotImplementedError

    def final_choice(self, choice: ChoiceState) -> dict:
        raise NotImplementedError

    def opening(self, gen: Generation) -> list[dict]:
        return [self._chunk(gen, [c]) for c in self.opening_choices(gen.choices)]

    def stream_events(self, gen: Generation, choice: ChoiceState, text: str,
                      entries: list) -> list[dict]:
        return [self._chunk(gen, [c]) for c in self.stream_choices(choice, text, entries)]

    def closing(self, gen: Generation) -> list[dict]:
        usage_chunk = [self._chunk(gen, [], gen.usage())] if gen.include_usage else []
        return usage_chunk + [{"data": "[DONE]"}]

    def failed(self, gen: Generation, exc: Exception) -> list[dict]:
        return [{"data": json.dumps(error_body_of(exc))}, {"data": "[DONE]"}]

    def body(self, gen: Generation) -> dict:
        return envelope(self.object, gen.completion_id, gen.state.model_name,
                        [self.final_choice(c) for c in gen.choices], usage=gen.usage())

    def _chunk(self, gen: Generation, choices: list[dict], usage_body: dict | None = None
               ) -> dict:
        extra = {"usage": usage_body} if gen.include_usage else {}
        body = envelope(self.chunk_object, gen.completion_id, gen.state.model_name, choices,
                        **extra)
        return {"data": json.dumps(body)}


def error_body_of(exc: Exception) -> dict:
    """The OpenAI error body of a failure inside a stream: an APIError says what it is, anything
    else is logged and reported without its insides."""
    if isinstance(exc, APIError):
        return error_body(exc.status, exc.message, exc.param, exc.code)
    log.error("error in a stream: %s", exc)
    return error_body(500, "the request failed while generating", None, "generation_failed")


class ChatRenderer(ChunkRenderer):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, with_logprobs: bool) -> None:
        super().__init__(tokenizer, with_logprobs)
        self._num_calls_sent: dict[int, int] = {}  # per streamed choice

    @classmethod
    def for_request(cls, tokenizer, req: ChatCompletionRequest) -> ChatRenderer:
        return cls(tokenizer, req.logprobs)

    def opening_choices(self, choices: list[ChoiceState]) -> list[dict]:  # the role, first
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for c in choices]

    def stream_choices(self, choice: ChoiceState, text: str, entries: list) -> list[dict]:
        out = []
        if text or entries:
            out.append({"index": choice.index, "delta": {"content": text},
                        "logprobs": self.logprobs(entries), "finish_reason": None})
        sent = self._num_calls_sent.get(choice.index, 0)
        calls = choice.tool_calls.calls[sent:] if choice.tool_calls is not None else []
        for k, call in enumerate(calls):  # each call whole, once it is complete
            out.append({"index": choice.index, "delta": {"tool_calls": [
                {"index": sent + k, **call}]}, "logprobs": None, "finish_reason": None})
        self._num_calls_sent[choice.index] = sent + len(calls)
        if choice.done:  # the finish reason comes in a chunk of its own, with an empty delta
            out.append({"index": choice.index, "delta": {}, "logprobs": None,
                        "finish_reason": choice.finish_reason})
        return out

    def final_choice(self, choice: ChoiceState) -> dict:
        message = {"role": "assistant", "content": choice.text}
        calls = choice.tool_calls.calls if choice.tool_calls is not None else []
        if calls:
            message["content"] = choice.text if choice.text.strip() else None
            message["tool_calls"] = calls
        return {"index": choice.index, "message": message,
                "logprobs": self.logprobs(choice.entries), "finish_reason": choice.finish_reason}

    def logprobs(self, entries: list) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [{**self._token(tok, chosen),
                             "top_logprobs": [self._token(t, lp) for t, lp in top]}
                            for tok, (chosen, top) in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionRenderer(ChunkRenderer):
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
