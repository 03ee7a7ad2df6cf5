"""`POST /v1/responses` end to end: one real server (paged engine, a chat template that shows tools,
calls and tool results), driven by the real `openai` SDK, whose typed objects must parse every reply.

Oracle: a Responses request is the chat request it maps to, so greedy text and usage equal
`/v1/chat/completions` on the same conversation; streamed deltas equal the whole reply.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from handlers.errors import HttpError
from handlers.responses_format import Head, stream
from handlers.responses_schema import parse_responses
from handlers.schemas import RequestLimits
from tests.support import running_server
from tests.test_structured import SCHEMA  # bounded fields: enums, maxLength, maxItems

TEMPLATE = (  # Zephyr-like, with the tools, the calls (Hermes blocks) and the tool results' call ids
    "{{ bos_token }}{% if tools %}<|system|>\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "{{ eos_token }}\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}] {% endif %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}</tool_call>{% endfor %}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% endif %}")
PROPERTIES = ("engine=Python\noption.rolling_batch=lmi-dist\noption.dtype=fp32\noption.kv_cache_memory=8MiB\n"
              "option.max_rolling_batch_size=8\noption.tool_call_parser=hermes\noption.max_new_tokens=64\n"
              "option.chat_template={template}\n")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "parameters": TIME}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
EVENT = TypeAdapter(ResponseStreamEvent)
GREEDY = dict(model="tiny-llama", temperature=0, max_output_tokens=12)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    (tmp / "template.jinja").write_text(TEMPLATE)
    yield from running_server(tmp, PROPERTIES.format(template=tmp / "template.jinja"), tiny_model)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny-llama", messages=messages, temperature=0, max_tokens=12,
                                          **kwargs)


def assert_same_as_chat(resp, completion):
    (choice,) = completion.choices
    assert resp.output_text == choice.message.content
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == \
        (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)
    cut = choice.finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    assert resp.incomplete_details == (openai.types.responses.response.IncompleteDetails(reason="max_output_tokens")
                                       if cut else None)


def test_instructions_and_text_input_equal_chat_with_a_system_message(client):
    resp = client.responses.create(instructions="You answer briefly.", input="The river ran", metadata={"k": "v"},
                                   **GREEDY)
    completion = chat(client, [{"role": "system", "content": "You answer briefly."},
                               {"role": "user", "content": "The river ran"}])
    assert_same_as_chat(resp, completion)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "tiny-llama"
    (item,) = resp.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert [c.type for c in item.content] == ["output_text"] and item.content[0].annotations == []
    assert (resp.instructions, resp.temperature, resp.top_p, resp.max_output_tokens) == \
        ("You answer briefly.", 0, 1.0, 12)
    assert resp.metadata == {"k": "v"} and resp.tools == [] and resp.tool_choice == "auto"
    assert resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0 and resp.text.format.type == "text"


def test_a_history_of_calls_and_results_equals_the_chat_conversation(client):
    items = [{"role": "developer", "content": "Use the tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                              {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo", "unit": "c"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is 12.", "annotations": []}]},
             {"role": "user", "content": "And tomorrow?"}]
    resp = client.responses.create(input=items, tools=TOOLS, **GREEDY)  # tool_choice auto: the template shows them
    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather\nin Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
                {"role": "assistant", "content": "It is 12."}, {"role": "user", "content": "And tomorrow?"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    assert_same_as_chat(resp, chat(client, messages, tools=chat_tools))
    assert [t.name for t in resp.tools] == ["get_weather", "get_time"] and resp.tool_choice == "auto"
    assert [item.type for item in resp.output] == ["message"]


def test_a_stream_is_well_formed_and_its_deltas_are_the_whole_text(client):
    kwargs = dict(input="Once upon a time", **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} and events[-2].item.content[0].text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == whole.output_text
    assert final.usage == whole.usage and events[0].response.status == "in_progress"
    with client.responses.stream(input="Once upon a time", model="tiny-llama", temperature=0,
                                 max_output_tokens=8) as helper:
        text = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
    assert text == client.responses.create(input="Once upon a time", model="tiny-llama", temperature=0,
                                           max_output_tokens=8).output_text
    with client.responses.stream(input="Paris?", model="tiny-llama", tools=TOOLS, max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"}) as helper:
        (call,) = helper.get_final_response().output  # (the helper finalises a completed response only)
    assert call.parsed_arguments == json.loads(call.arguments) and call.name == "get_weather"  # (a strict tool)


def test_max_output_tokens_cuts_the_response_as_incomplete(client):
    kwargs = dict(input="The mill", model="tiny-llama", temperature=0, max_output_tokens=3,
                  extra_body={"ignore_eos": True})
    resp = client.responses.create(**kwargs)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == resp.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_function_call_items_whose_arguments_fit_the_schema(client, stream):
    """A named function: one call, completed. "required": this random model keeps adding calls to the
    array until max_output_tokens cuts it; the calls read before the cut are whole, and completed."""
    for choice, names, status in (({"type": "function", "name": "get_time"}, {"get_time"}, "completed"),
                                  ("required", set(PARAMS), "incomplete")):
        kwargs = dict(input="The weather in Paris?", tools=TOOLS, tool_choice=choice, model="tiny-llama",
                      temperature=0, max_output_tokens=60)
        if stream:
            events = list(client.responses.create(**kwargs, stream=True))
            resp = events[-1].response
            assert events[-1].type == f"response.{status}"
            done = [e for e in events if e.type == "response.function_call_arguments.done"]
            for e in done:
                assert "".join(d.delta for d in events if d.type == "response.function_call_arguments.delta"
                               and d.item_id == e.item_id) == e.arguments
            assert [e.arguments for e in done] == [item.arguments for item in resp.output]
        else:
            resp = client.responses.create(**kwargs)
        assert resp.status == status and all(item.type == "function_call" for item in resp.output)
        assert len(resp.output) == 1 if status == "completed" else resp.usage.output_tokens == 60
        for call in resp.output:
            assert call.name in names and call.call_id.startswith("call_") and call.id.startswith("fc_")
            assert call.status == "completed"
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


def test_a_json_schema_text_format_gives_json_that_validates(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    resp = client.responses.create(input="A thing:", text={"format": fmt}, model="tiny-llama", temperature=0,
                                   max_output_tokens=200)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "thing"
    obj = client.responses.create(input="A thing:", text={"format": {"type": "json_object"}}, model="tiny-llama",
                                  temperature=0, max_output_tokens=60)
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"store": True}, "store", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "background"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "\"web_search\""),
    ({"tools": [{"type": "function", "name": ""}]}, "tools", "tools[0].name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs \"tools\""),
    ({"input": []}, "input", "non-empty"),
    ({"input": ""}, "input", "non-empty"),
    ({"input": 5}, "input", "non-empty"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "\"item_reference\""),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input", "call_9"),
    ({"instructions": 3}, "instructions", "string"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format", "name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "uniqueItems": True}}}},
     "text.format", "\"text.format\""),
    ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported parameter"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported parameter"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(server, extra, param, words):
    resp = requests.post(server.url + "/v1/responses", json={"model": "tiny-llama", "input": "Hi", **extra}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


def test_the_sdk_raises_its_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny-llama", input="Hi", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"


def test_raw_bodies_and_events_validate_strictly_against_the_sdk_models(server):
    body = {"model": "tiny-llama", "input": "The river ran", "temperature": 0, "max_output_tokens": 5,
            "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}
    Response.model_validate(requests.post(server.url + "/v1/responses", json=body, timeout=60).json(), strict=False)
    resp = requests.post(server.url + "/v1/responses", json=dict(body, stream=True, tool_choice="none"), stream=True,
                         timeout=60)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(resp.content)
    for name, event in events:
        assert EVENT.validate_python(event).type == name == event["type"]


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event():
    class FailingGeneration:  # one token, then the engine dies
        finish_reason, num_prompt_tokens, num_generated_tokens, closed = None, 3, 1, False

        def tokens(self, deadline, is_gone):
            yield {"text": "Hi", "last": False}
            raise HttpError(424, "the model failed during generation: boom")

        def close(self):
            self.closed = True

    req, settings = parse_responses({"input": "x", "stream": True}, default_max_tokens=5, limits=RequestLimits(),
                                    tool_parser=None)
    gen = FailingGeneration()
    events = sse_events(b"".join(stream(req, gen, Head("m", settings), 0.0, lambda: False)))
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added", "response.output_text.delta", "error"]
    assert events[-1][1] == {"type": "error", "code": "model_error", "param": None, "sequence_number": 5,
                             "message": "the model failed during generation: boom"}
    assert all(EVENT.validate_python(event) for _, event in events) and gen.closed


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """`event: <type>\\ndata: <json>` blocks → (type, data)."""
    blocks = [block.split("\n") for block in raw.decode().split("\n\n") if block]
    assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks), raw
    return [(b[0][len("event: "):], json.loads(b[1][len("data: "):])) for b in blocks]
