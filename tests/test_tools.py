"""Tool calling and structured output end to end (real server, the OpenAI SDK, TGI's client, LMI's
schema), and the tool-call readers on scripted replies fed whole and a character at a time."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

from handlers.chat_template import ChatTemplate
from handlers.tools import ArrayReader, HermesReader, Llama3JsonReader, MistralReader, NamedReader, delta, gather
from tests.support import running_server
from tests.test_structured import SCHEMA  # bounded fields: enums, maxLength, maxItems

PROPERTIES = ("engine=Python\noption.rolling_batch=lmi-dist\noption.dtype=fp32\noption.kv_cache_memory=8MiB\n"
              "option.max_rolling_batch_size=16\noption.tool_call_parser=hermes\noption.max_new_tokens=200\n")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("tools"), PROPERTIES, tiny_model)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_fifty_json_schema_replies_parse_and_validate(server, client):
    """The acceptance: strict json_schema on bounded fields, sampled at temperature 1 on random weights."""
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

    def ask(seed: int):
        return client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": f"Thing {seed}"}],
                                              response_format=fmt, seed=seed, max_tokens=200)

    before = grammar_masks(server)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(50)))
    choices = [r.choices[0] for r in replies]
    assert [c.finish_reason for c in choices] == ["stop"] * 50
    for c in choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({c.message.content for c in choices}) > 10  # sampled, not one reply
    # a mask for every generated token (and the next ones computed ahead)
    assert grammar_masks(server) - before >= sum(r.usage.completion_tokens for r in replies)


def grammar_masks(server) -> float:
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("lmi_grammar_masks_total"))


def test_tgi_client_grammar_and_lmi_parameters_give_valid_json(server):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    tgi = Client(server.url, timeout=60)
    def ask(seed: int):
        return tgi.generate("A thing:", do_sample=True, seed=seed, max_new_tokens=200,
                            grammar=Grammar(type=GrammarType.Json, value=SCHEMA))

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(ask, range(24)))
    for out in outs:
        assert out.details.finish_reason == "eos_token"
        jsonschema.validate(json.loads(out.generated_text), SCHEMA)
    forms = [{"grammar": {"type": "json", "value": SCHEMA}}, {"guided_json": SCHEMA},
             {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}]

    def lmi(seed: int) -> dict:  # the LMI schema, each form
        return server.post({"inputs": "A thing:", "parameters": {"max_new_tokens": 200, "do_sample": True,
                                                                  "seed": seed, "details": True,
                                                                  **forms[seed % 3]}}).json()

    with ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(lmi, range(24)))
    for body in bodies:
        assert body["details"]["finish_reason"] == "eos_token"
        jsonschema.validate(json.loads(body["generated_text"]), SCHEMA)
    regex = server.post({"inputs": "A code:", "parameters": {"max_new_tokens": 20,
                                                              "guided_regex": "[A-Z]{3}-[0-9]{2}"}}).json()
    assert len(regex["generated_text"]) == 6 and regex["generated_text"][3] == "-"
    choice = client_choice(server, {"guided_choice": ["alpha", "beta"]})
    assert choice in ("alpha", "beta")


def client_choice(server, extra: dict) -> str:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return c.completions.create(model="tiny-llama", prompt="Pick:", max_tokens=10, extra_body=extra).choices[0].text


def check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_streamed_and_not(server, client, choice):
    names = None if choice == "required" else ["get_time"]
    for seed in range(4):
        out = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                             seed=seed, max_tokens=200)
        (c,) = out.choices
        assert c.finish_reason == "stop" and c.message.content is None
        check_calls(c.message.tool_calls, names)
        stream = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                seed=seed, max_tokens=200, stream=True)
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] = (d.function.name if d.function and d.function.name else None) or entry["name"]
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "stop"
        # the same seed: the stream's calls are the whole reply's
        assert [(e["name"], e["arguments"]) for _, e in sorted(calls.items())] == \
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_auto_returns_calls_or_content_as_the_model_writes_them(server, client):
    """The reply scripted by a regex (the model writes exactly that): a Hermes block is a call, plain
    text is content; streamed the same."""
    scripted = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    rx = scripted.replace("{", "\\{").replace("}", "\\}")
    out = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                         extra_body={"guided_regex": "Sure\\. " + rx})
    (c,) = out.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "unit": "c"})]
    plain = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=50,
                                           extra_body={"guided_regex": "No tools needed\\."}).choices[0]
    assert plain.message.content == "No tools needed." and plain.message.tool_calls is None
    assert plain.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                 stream=True, extra_body={"guided_regex": "Sure\\. " + rx}))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert content == "Sure. " and deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Oslo", "unit": "c"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tgi_client_chat_with_a_function_named_by_a_bare_string(server):
    """TGI's form: tool_choice is the function's name; its client parses the reply."""
    from text_generation import Client
    from text_generation.types import Message, Tool

    tgi = Client(server.url, timeout=60)
    out = tgi.chat(messages=[Message(role="user", content="Time?")], tools=[Tool(**t) for t in TOOLS],
                   tool_choice="get_time", seed=1, max_tokens=200)
    (call,) = out.choices[0].message.tool_calls
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)


def test_tool_prompt_goes_after_the_last_message_with_the_tools_when_the_template_has_none():
    from handlers.tools import parse_tools

    tools = parse_tools({"tools": TOOLS[:1], "tool_choice": "required", "tool_prompt": "Use a tool."}, None)
    plain = tools.with_prompt(MESSAGES, template_uses_tools=False)
    assert plain[-1]["content"] == MESSAGES[-1]["content"] + "\n---\nUse a tool.\n" + \
        json.dumps([TOOLS[0]["function"]])
    assert tools.with_prompt(MESSAGES, template_uses_tools=True)[-1]["content"] == \
        MESSAGES[-1]["content"] + "\n---\nUse a tool."


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in \"tools\""),
    ({"tool_choice": "required"}, "tool_choice", "needs \"tools\""),
    ({"tools": [{"type": "function"}]}, "tools", "must be {\"type\": \"function\""),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
     "response_format", "uniqueItems"),
])
def test_bad_tool_and_format_requests_are_400s_naming_the_field(server, client, body, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, extra_body=body)
    assert err.value.body["param"] == param and words in err.value.body["message"]


# -- readers on scripted replies ------------------------------------------------------------------------------

def read(reader, text: str, piecewise: bool):
    events = [e for ch in text for e in reader.feed(ch)] if piecewise else reader.feed(text)
    return gather(events + reader.finish())


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "by-character"])
def test_each_reader_finds_the_calls_and_the_content(piecewise):
    hermes = ('Let me check. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
              '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = read(HermesReader(), hermes, piecewise)
    assert content == "Let me check. \n" and calls_of(calls) == [("a", {"x": 1}), ("b", {})]
    assert read(HermesReader(), "a < b <tool_ and no call", piecewise) == ("a < b <tool_ and no call", [])
    assert read(HermesReader(), "<tool_call>{not json}</tool_call>", piecewise) == \
        ("<tool_call>{not json}</tool_call>", [])
    content, calls = read(Llama3JsonReader(), ' {"name": "a", "parameters": {"x": "y"}}; {"name": "b", "parameters": {}}',
                          piecewise)
    assert content is None and calls_of(calls) == [("a", {"x": "y"}), ("b", {})]
    content, calls = read(Llama3JsonReader(), '<|python_tag|>{"name": "a", "arguments": {"q": 2}}', piecewise)
    assert calls_of(calls) == [("a", {"q": 2})]
    assert read(Llama3JsonReader(), "Plain {text}", piecewise) == ("Plain {text}", [])
    assert read(Llama3JsonReader(), '{"not": "a call"}', piecewise) == ('{"not": "a call"}', [])
    content, calls = read(MistralReader(), '[TOOL_CALLS][{"name": "a", "arguments": {"k": [1]}}]', piecewise)
    assert content is None and calls_of(calls) == [("a", {"k": [1]})]
    assert read(MistralReader(), "[TOOL] no", piecewise) == ("[TOOL] no", [])
    content, calls = read(ArrayReader(), '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]', piecewise)
    assert content is None and calls_of(calls) == [("a", {"x": 1}), ("b", {})]
    content, calls = read(NamedReader("f"), '{"x":1}', piecewise)
    assert content is None and calls_of(calls) == [("f", {"x": 1})]


def test_streamed_deltas_send_a_call_when_its_object_closes():
    reader = ArrayReader()
    assert reader.feed('[{"name":"a","parameters":{"x"') == []
    d = delta(reader.feed(':1}},'))
    assert d["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"x": 1}'} and d["tool_calls"][0]["index"] == 0
    hermes = HermesReader()
    assert delta(hermes.feed("Hi <tool")) == {"content": "Hi "}  # "<tool" may start a call: held back
    assert delta(hermes.feed("s>")) == {"content": "<tools>"}


def test_the_chat_template_receives_the_tools_as_transformers_passes_them():
    template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]"
                            "{% endfor %}{{ messages[0].content }}")
    assert template.render(MESSAGES, tools=TOOLS[:1]) == \
        '[get_weather:' + json.dumps(WEATHER) + ']The weather in Paris?'
