"""Request validation: a parsed request becomes prompt ids and SamplingParams, or an APIError.

The engine is the one judge of what it can run: `SamplingParams` checks ranges and the engine's
own check (`EngineClient.validate`) the vocabulary, the context and max_tokens' room; both raise
`InvalidRequestError` naming the field, which becomes a 400 naming the endpoint's field. What only
the server knows stays here: admission (draining, loading, queue), the model name, n, the chat
template and the completion prompt's shapes. Must not touch a `Sequence` nor submit anything.
"""

from __future__ import annotations

import math

from engine import InvalidRequestError, SamplingParams
from engine.sample.keys import choice_seed
from server import tool_grammar
from server import tools
from server.errors import APIError
from server.middleware import TENANT
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.state import ServerState


def check_accepting(state: ServerState) -> None:
    retry = {"Retry-After": str(state.config.server.retry_after_s)}
    if state.draining:
        raise APIError(503, "the server is shutting down", None, "draining", retry)
    if state.client is None or not state.client.alive:
        message = ("the model is still loading" if state.dead is None else
                   f"the engine is not running: {state.dead}")
        raise APIError(503, message, None, "not_ready", retry)
    client, limit = state.client, state.config.server.max_waiting_requests
    queued = client.num_queued
    if queued >= limit:
        retry = {"Retry-After": str(retry_after_s(queued - limit + 1, client.drain_rate(),
                                                  state.config.server.retry_after_s))}
        raise APIError(429, "too many requests are waiting; retry later", None,
                       "queue_full", retry)


def retry_after_s(num_to_drain: int, drain_rate: float | None, least_s: int) -> int:
    """Seconds until `num_to_drain` requests finish at the measured rate (requests/s), in
    [least_s, 60]; `least_s` before anything was measured."""
    if not drain_rate:
        return least_s
    return min(60, max(least_s, math.ceil(num_to_drain / drain_rate)))


def cache_salt(state: ServerState, request, req) -> str | None:
    """The request's prefix-cache partition: its own `cache_salt`, else its API key's tenant
    (set by AuthMiddleware) unless the config shares the cache across keys, else None.

    The prefixes keep the two kinds apart: no request salt can name a key's partition."""
    if req.cache_salt is not None:
        return "salt:" + req.cache_salt
    tenant = request.scope.get("state", {}).get(TENANT)
    if tenant is not None and state.config.server.cache_salt_per_api_key:
        return "key:" + tenant
    return None


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", "model", "model_not_found")


# -- per endpoint: (prompt ids, one SamplingParams per choice) --------------------------------

def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> tuple[list[int], list]:
    check_tool_choice(req)
    prompt_ids = chat_prompt_ids(state, req)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    fmt = request_grammar(req)
    return prompt_ids, sampling_params(state, req, prompt_ids, max_tokens, num_logprobs,
                                       prompt_field="messages",
                                       grammar=call_grammar(state, req, fmt) or fmt)


def check_tool_choice(req: ChatCompletionRequest) -> None:
    mode = req.tool_mode
    if mode in ("required", "named") and not req.tools:
        raise APIError(400, f"tool_choice {mode!r} needs tools", "tool_choice", "invalid_value")
    if mode == "named":
        name = req.tool_choice.function.name
        if name not in {t.function.name for t in req.tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                                f"tools", "tool_choice", "invalid_value")
    if req.tools and len({t.function.name for t in req.tools}) < len(req.tools):
        raise APIError(400, "tools: function names must be unique", "tools", "invalid_value")
    check_tool_results(req)


def check_tool_results(req: ChatCompletionRequest) -> None:
    """Every tool message answers a call of an earlier assistant message, by its id."""
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        called.update(c.id for c in m.tool_calls or ())
        if m.role == "tool" and m.tool_call_id not in called:
            raise APIError(400, f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no "
                                f"earlier assistant tool call", f"messages.{i}.tool_call_id",
                           "invalid_value")


def call_grammar(state: ServerState, req: ChatCompletionRequest,
                 fmt: tuple[str, str] | None) -> tuple[str, str] | None:
    """The grammar of the calls tool_choice allows: "required" or a named function (calls
    only: a response_format, which shapes text, has no text to shape in that turn, as agents
    that force a tool before a structured answer expect), "auto" (text or calls; unless
    response_format or guided decoding, `fmt` (request_grammar's), constrains the answer
    instead), else None."""
    mode = req.tool_mode
    if mode == "none" or (fmt is not None and mode == "auto"):
        return None
    if not req.tools:  # "auto" of no tools (check_tool_choice refused the forced modes)
        return None
    offered = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        if mode == "auto":
            grammar = tool_grammar.auto_grammar(state.tokenizer, offered,
                                                req.parallel_tool_calls)
        else:
            name = req.tool_choice.function.name if mode == "named" else None
            grammar = tool_grammar.forced_grammar(state.tokenizer, offered, name,
                                                  req.parallel_tool_calls)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"invalid tools: {exc}", "tools", "invalid_value") from None
    return grammar, "tools"


def prepare_completion(state: ServerState, req: CompletionRequest) -> tuple[list[int], list]:
    prompt_ids = completion_prompt_ids(state, req)
    return prompt_ids, sampling_params(state, req, prompt_ids, req.max_tokens or 16,
                                       req.logprobs, prompt_field="prompt")


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions",
                       "messages", "no_chat_template")
    offered = ([t.model_dump(exclude_none=True) for t in req.tools]
               if req.tools and req.tool_mode != "none" else None)
    try:
        messages, template_tools = tools.template_messages(
            [m.as_dict() for m in req.messages], offered, tools.template_knows_tools(tok))
    except ValueError as exc:  # an earlier call's arguments that are not a JSON object
        raise APIError(400, str(exc), "messages", "invalid_value") from None
    try:
        ids = tok.apply_chat_template(messages, tools=template_tools,
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    except Exception as exc:  # a template may reject a message order
        raise APIError(400, f"the chat template rejected the messages: {exc}", "messages",
                       "invalid_messages") from None
    return list(ids)


def completion_prompt_ids(state: ServerState, req: CompletionRequest) -> list[int]:
    """Text or token ids; token ids are checked against the vocabulary by the engine."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
        return ids
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    raise APIError(400, "batched prompts are not supported; send one prompt per request",
                   "prompt", "invalid_value")


# -- shared ----------------------------------------------------------------------------------

def sampling_params(state: ServerState, req, prompt_ids: list[int], max_tokens: int | None,
                    num_logprobs: int | None, prompt_field: str,
                    grammar: tuple[str, str] | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice, checked once by the engine; a 400 naming the field.

    `prompt_field` is the endpoint's name for what the engine calls the prompt; `grammar` is
    (grammar, the request field it comes from), or None for `request_grammar(req)`."""
    max_n = state.config.server.max_n
    if req.n > max_n:  # before building n of them
        raise APIError(400, f"n must be at most {max_n}", "n", "invalid_value")
    grammar, grammar_field = grammar or request_grammar(req) or (None, None)
    # without max_tokens a choice may fill the context; at least 1, so that a prompt too long
    # for the context is what the engine reports
    room = max(1, state.client.info.max_model_len - len(prompt_ids))
    prediction = prediction_ids(state, req)
    try:
        params = [_choice_params(req, i, max_tokens or room, num_logprobs, grammar, prediction)
                  for i in range(req.n)]
        state.client.validate(prompt_ids, params[0])  # the choices differ only in their seed
    except InvalidRequestError as exc:
        param = {"prompt": prompt_field, "grammar": grammar_field}.get(exc.param, exc.param)
        message = exc.message
        if exc.param == "grammar" and grammar_field:
            message = message.replace("invalid grammar", f"invalid {grammar_field}", 1)
        raise APIError(400, message, param, exc.code) from None
    return params


def request_grammar(req) -> tuple[str, str] | None:
    """(grammar, request field) of the request's structured-output constraint, or None:
    `response_format` (json_object, json_schema), `guided_regex` or `guided_choice`."""
    from engine import structured

    given = [name for name in ("guided_regex", "guided_choice")
             if getattr(req, name, None) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise APIError(400, f"give at most one of {', '.join(given)}", given[1],
                       "invalid_value")
    if not given:
        return None
    try:
        if given[0] == "guided_regex":
            return structured.regex(req.guided_regex), "guided_regex"
        if given[0] == "guided_choice":
            return structured.choice(req.guided_choice), "guided_choice"
        schema = fmt.json_schema.json_schema if fmt.type == "json_schema" else None
        return structured.json_schema(schema), "response_format"
    except (ValueError, TypeError) as exc:  # the compilers refuse what is not a schema
        raise APIError(400, f"invalid {given[0]}: {exc}", given[0], "invalid_value") from None


def prediction_ids(state: ServerState, req) -> list[int] | None:
    """The request's Predicted Output as token ids (None: none given); at most the context
    long."""
    if req.prediction is None:
        return None
    ids = state.tokenizer.encode(req.prediction.text(), add_special_tokens=False)
    limit = state.client.info.max_model_len
    if len(ids) > limit:
        raise APIError(400, f"the prediction is {len(ids)} tokens; at most {limit} (the "
                            f"context)", "prediction", "invalid_value")
    return ids


def _choice_params(req, index: int, max_tokens: int, num_logprobs: int | None,
                   grammar: str | None, prediction: list[int] | None) -> SamplingParams:
    seed = None if req.seed is None else choice_seed(req.seed, index)
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias, seed=seed, logprobs=num_logprobs, ignore_eos=req.ignore_eos,
        speculative=req.speculative is not False, grammar=grammar, prediction=prediction)
