"""Tool calls through the official ``openai`` client, on a 2-node mesh of the bundled model.

SmolLM2's template does not render tools: they are described in a system
message and calls read back in the Hermes syntax; ``required`` and a named
function are enforced by the grammar engine on the last hop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from conftest import MeshFactory
from tiny_requests import openai_client

from meshnet.local_mesh import LocalMesh

pytestmark = pytest.mark.bundled

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    return mesh_factory("0:15,15:30")


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with openai_client(mesh) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _ask(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    base: dict[str, Any] = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=80)
    return client.chat.completions.create(**{**base, **kwargs})


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", range(5))
def test_required_returns_calls_whose_arguments_validate(
    client: openai.OpenAI, model: str, seed: int
) -> None:
    r = _ask(client, model, tool_choice="required", temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)


def test_streamed_calls_equal_the_whole_ones(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(tool_choice="required", temperature=0.8, seed=3)
    whole = _ask(client, model, **kwargs).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in _ask(client, model, stream=True, **kwargs):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            got = calls.setdefault(d.index, {"name": "", "arguments": ""})
            got["name"] += (d.function.name or "") if d.function else ""
            got["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ]


def test_a_named_function_is_the_one_called(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _ask(client, model, tool_choice=named, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _valid("get_time", call.function.arguments)


def test_no_parallel_calls_gives_exactly_one(client: openai.OpenAI, model: str) -> None:
    r = _ask(
        client, model, tool_choice="required", parallel_tool_calls=False, temperature=1, seed=9
    )
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_tool_result_goes_back_into_the_prompt(client: openai.OpenAI, model: str) -> None:
    first = _ask(client, model, tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=20,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None
    bare = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage is not None and bare.usage is not None
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the call and its result


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    client: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, model, **kwargs)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


def test_a_tool_message_without_its_call_id_is_a_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model,
            messages=[*ASK, {"role": "tool", "content": "21"}],  # type: ignore[list-item]
            max_tokens=4,
        )


def test_an_openai_agents_tool_loop_completes_a_round_trip(mesh: LocalMesh, model: str) -> None:
    """The ``openai-agents`` SDK's loop, unchanged: the model calls the tool (required on
    the first turn; the SDK resets it to auto after), the SDK runs it and sends the
    result back, and the model answers."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    ran: list[dict[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city.

        Args:
            city: The city.
            unit: celsius or fahrenheit.
        """
        ran.append({"city": city, "unit": unit})
        return f"21 degrees {unit} and sunny in {city}"

    async def loop() -> Any:
        key = mesh.credentials.api_key
        async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key=key) as client:
            settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60)
            agent = agents.Agent(
                name="weather",
                instructions="Answer with the weather tool.",
                tools=[get_weather],
                model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
                model_settings=settings,
            )
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(loop())
    assert len(ran) >= 1 and all(set(r) == {"city", "unit"} for r in ran)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == len(outputs) == len(ran)
    assert isinstance(result.final_output, str)
