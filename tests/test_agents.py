"""Agent loops end to end: LangChain's agent (`create_agent` over `ChatOpenAI`, over chat
completions and over the Responses API) and the OpenAI Agents SDK (its default Responses model
path, and chat completions) against the server. A task needs one tool call, the tool's result, then a text
answer. On a tiny random model the first turn is forced (`required`), as agents force a tool
when they must; on the real default model (Qwen2.5-Coder-1.5B, marked real_model) it is `auto`."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from server_utils import ServerProcess, save_tiny_model, tiny_server

TINY = "tiny"
QUESTION = "What's the weather in Paris right now?"
INSTRUCTIONS = ("You are a helpful assistant with tools. When a <tool_response> is in the "
                "conversation, the tool has already run: do not call it again, answer the user's "
                "question from it in one plain sentence.")
REPORT = "21 degrees Celsius and sunny"
# short ASCII strings: a random model never ends a string by itself, and characters outside
# ASCII cost the tiny tokenizer several tokens each
City = Annotated[str, Field(pattern=r"^[A-Za-z ]{1,12}$")]
Zone = Annotated[str, Field(pattern=r"^[A-Za-z/_]{1,8}$")]


class WeatherArgs(BaseModel):
    city: City


class TimeArgs(BaseModel):
    zone: Zone


class Calls:
    """The agent's tools, recording what they were called with."""

    def __init__(self) -> None:
        self.made: list[tuple[str, dict]] = []

    def get_weather(self, city: str) -> str:
        self.made.append(("get_weather", {"city": city}))
        return REPORT

    def get_time(self, zone: str) -> str:
        self.made.append(("get_time", {"zone": zone}))
        return "14:05"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    with tiny_server(save_tiny_model(folder, max_positions=4096), TINY) as srv:
        yield srv


def langchain_agent(url: str, model: str, calls: Calls, first_turn: str | None,
                    responses: bool = False):
    """LangChain's agent with the two tools; `first_turn` forces the first model call's
    tool_choice (None: auto throughout); `responses`: ChatOpenAI over /v1/responses."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return calls.get_weather(city)

    @tool(args_schema=TimeArgs)
    def get_time(zone: str) -> str:
        """The current time in a time zone."""
        return calls.get_time(zone)

    @wrap_model_call
    def strict_tools_first_call_forced(request, handler):
        # strict: the schemas are closed (additionalProperties false), as the SDK's are
        request = request.override(model_settings={**request.model_settings, "strict": True})
        if first_turn and not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice=first_turn)
        return handler(request)

    llm = ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", temperature=0,
                     max_tokens=100, max_retries=0, use_responses_api=responses)
    return create_agent(llm, [get_weather, get_time], system_prompt=INSTRUCTIONS,
                        middleware=[strict_tools_first_call_forced])


def run_langchain(url: str, model: str, first_turn: str | None,
                  responses: bool = False) -> tuple[Calls, list]:
    calls = Calls()
    state = langchain_agent(url, model, calls, first_turn, responses).invoke(
        {"messages": [{"role": "user", "content": QUESTION}]}, {"recursion_limit": 8})
    return calls, state["messages"]


def run_agents_sdk(url: str, model: str, tool_choice: str | None, api: str = "responses",
                   output_type: type | None = None) -> tuple[Calls, object]:
    """The Agents SDK on its default model path (`api` "responses": a model named by a string,
    served by the default client over the Responses API) or over chat completions; after a
    tool call it resets tool_choice to auto (its default), so `required` forces the first turn
    only. `output_type`: the final answer's structure (text by default)."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner,
                        function_tool, set_default_openai_client, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = Calls()

    @function_tool
    def get_weather(city: City) -> str:
        """The current weather in a city."""
        return calls.get_weather(city)

    @function_tool
    def get_time(zone: Zone) -> str:
        """The current time in a time zone."""
        return calls.get_time(zone)

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    if api == "responses":
        set_default_openai_client(client, use_for_tracing=False)
        served = model  # the SDK's default: OpenAIResponsesModel on the default client
    else:
        served = OpenAIChatCompletionsModel(model=model, openai_client=client)
    agent = Agent(name="assistant", instructions=INSTRUCTIONS, tools=[get_weather, get_time],
                  model=served, output_type=output_type,
                  model_settings=ModelSettings(tool_choice=tool_choice, temperature=0,
                                               max_tokens=100))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))
    return calls, result


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_langchain_agent_on_a_tiny_model(tiny, responses):
    calls, messages = run_langchain(tiny.url, TINY, first_turn="required", responses=responses)
    assert len(calls.made) >= 1 and calls.made[0][0] in ("get_weather", "get_time")
    tool_messages = [m for m in messages if m.type == "tool"]
    assert tool_messages and tool_messages[0].content in (REPORT, "14:05")
    # (over the Responses API the content is a list of blocks; .text joins them)
    assert messages[-1].type == "ai" and messages[-1].text and not messages[-1].tool_calls


def test_openai_agents_sdk_on_a_tiny_model_over_chat(tiny):
    calls, result = run_agents_sdk(tiny.url, TINY, tool_choice="required", api="chat")
    assert len(calls.made) >= 1
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)


def test_openai_agents_sdk_on_its_default_responses_path(tiny):
    """A random model never ends a text answer, and the SDK takes an answer cut at
    max_output_tokens (an incomplete response) for a failure: the answer here is structured,
    so the grammar ends it."""
    calls, result = run_agents_sdk(tiny.url, TINY, tool_choice="required", api="responses",
                                   output_type=WeatherArgs)
    assert len(calls.made) >= 1
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, WeatherArgs)
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)


# -- the real default model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The default config's models (fetched by their recipes), served as `make serve` does."""
    from engine.models.recipes import fetch

    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        fetch(name)
    srv = ServerProcess(["--config", "configs/default.yaml", "--num-threads", "2"]
                        ).wait_ready(timeout=300)
    yield srv
    assert srv.terminate() == 0, srv.log()


QWEN = "qwen2.5-coder-1.5b-instruct"


@pytest.mark.real_model
def test_langchain_agent_on_the_default_model(qwen):
    calls, messages = run_langchain(qwen.url, QWEN, first_turn=None)
    assert calls.made == [("get_weather", {"city": "Paris"})]
    assert messages[-1].type == "ai" and "21" in messages[-1].content
    assert not messages[-1].tool_calls


@pytest.mark.real_model
def test_openai_agents_sdk_on_the_default_model(qwen):
    calls, result = run_agents_sdk(qwen.url, QWEN, tool_choice=None)
    assert calls.made == [("get_weather", {"city": "Paris"})]
    assert "21" in result.final_output

