"""End to end: the OpenAI routes on both rolling engines, driven by the real `openai` client.

Oracles: greedy /v1/completions equals /invocations token for token; chat equals HF `generate` on
the prompt transformers' apply_chat_template renders; presence/frequency penalties equal a greedy
loop over the HF model that applies OpenAI's formula.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests
import torch

from tests.support import ids_of, running_server

ENGINES = {
    "paged": "engine=Python\noption.rolling_batch=lmi-dist\noption.dtype=fp32\noption.kv_cache_memory=4MiB\n"
             "option.enable_prefix_caching=true\n",
    "rolling": "engine=Python\noption.rolling_batch=scheduler\noption.dtype=fp32\n"
               "option.served_model_name=my-model\n",
}
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "The river ran"}]


@pytest.fixture(scope="module", params=sorted(ENGINES))
def server(request, tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp(request.param), ENGINES[request.param], tiny_model)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def served_name(server) -> str:
    return "my-model" if "my-model" in server.log() else "tiny-llama"


def template_ids(hf, messages) -> list[int]:
    return list(hf.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])


def test_models_lists_the_served_name(server, client):
    assert [m.id for m in client.models.list().data] == [served_name(server)]


def test_greedy_completion_equals_invocations_token_for_token(server, client, hf):
    prompt = "Once upon a time the mill"
    out = client.completions.create(model=served_name(server), prompt=prompt, max_tokens=12, temperature=0,
                                    logprobs=0)
    lmi = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}).json()
    (choice,) = out.choices
    assert choice.text == lmi["generated_text"]
    assert choice.logprobs.tokens == [hf.tokenizer.decode([i]) for i in ids_of(lmi)]
    assert choice.logprobs.token_logprobs == [t["log_prob"] for t in lmi["details"]["tokens"]]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(hf.tokenizer(prompt).input_ids)
    assert ids_of(lmi) == hf(prompt, 12)


def test_chat_equals_generating_from_the_rendered_template(server, client, hf):
    ids = template_ids(hf, MESSAGES)
    expected = hf(ids, 10)
    out = client.chat.completions.create(model=served_name(server), messages=MESSAGES, max_tokens=10,
                                         temperature=0)
    (choice,) = out.choices
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == hf.decode(expected)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(expected))
    assert choice.finish_reason == ("stop" if hf.tokenizer.eos_token_id in expected else "length")


def test_chat_stream_sends_the_role_first_then_the_same_text_then_usage(server, client):
    kwargs = dict(model=served_name(server), messages=MESSAGES, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_ends_with_done(server, hf):
    resp = requests.post(server.url + "/v1/completions", stream=True, timeout=60,
                         json={"prompt": "The river ran", "max_tokens": 4, "temperature": 0, "stream": True})
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in resp.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == hf.decode(hf("The river ran", 4))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_seeded_sampling_repeats_and_matches_invocations(server, client):
    kwargs = dict(model=served_name(server), prompt="Once upon a time", max_tokens=10, seed=7, temperature=0.9)
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    lmi = server.post({"inputs": "Once upon a time", "parameters": {
        "do_sample": True, "temperature": 0.9, "seed": 7, "max_new_tokens": 10}}).json()
    assert first == second == lmi["generated_text"]


def test_n_2_gives_two_different_reproducible_choices(server, client):
    kwargs = dict(model=served_name(server), messages=MESSAGES, max_tokens=10, n=2, seed=11)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    assert first.usage.completion_tokens == 20 and first.usage.prompt_tokens == again.usage.prompt_tokens


def test_n_choices_share_the_prompts_kv_through_the_prefix_cache(server, client):
    if "prefix caching on" not in server.log():
        pytest.skip("the padded engine has no prefix cache")
    def counters() -> tuple[float, float]:  # /metrics asks the engine itself (/ping shows a snapshot)
        text = requests.get(server.url + "/metrics", timeout=5).text
        value = lambda name: float(next(line.split()[-1] for line in text.splitlines()  # noqa: E731
                                        if line.startswith(name + " ")))
        return value("lmi_prefix_cache_hit_tokens_total"), value("lmi_prefix_cache_query_tokens_total")

    hits, queries = counters()
    prompt = "A prompt nobody sent before, long enough to fill several blocks of sixteen tokens " * 2
    out = client.completions.create(model=served_name(server), prompt=prompt, max_tokens=4, n=3, seed=5)
    assert len(out.choices) == 3
    hits_after, queries_after = counters()
    assert queries_after - queries == 3 * out.usage.prompt_tokens
    # choice 0 computes the prompt; choices 1 and 2 take its full blocks from the cache
    full_blocks = (out.usage.prompt_tokens - 1) // 16 * 16
    assert hits_after - hits == 2 * full_blocks > 0


def test_stop_cuts_the_text_and_reports_stop(server, client, hf):
    full = hf.decode(hf("The river ran", 12))
    stop = full[6:9]
    out = client.completions.create(model=served_name(server), prompt="The river ran", max_tokens=12,
                                    temperature=0, stop=[stop, "never-there"])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_chat_logprobs_with_top_logprobs(server, client):
    out = client.chat.completions.create(model=served_name(server), messages=MESSAGES, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def penalised_greedy(hf, ids: list[int], n: int, presence: float, frequency: float) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf.model(torch.tensor([ids + out])).logits[0, -1].float()
            for tok in set(out):
                logits[tok] -= frequency * out.count(tok) + presence
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("presence,frequency", [(0.6, 1.2), (-2.0, 0.0)])
def test_presence_and_frequency_penalties_follow_openai_formula(server, client, hf, presence, frequency):
    prompt = "Once upon a time"
    ids = hf.tokenizer(prompt).input_ids
    expected = penalised_greedy(hf, ids, 40, presence=presence, frequency=frequency)
    assert expected != hf(prompt, 40)  # the penalties matter for this prompt (else the test proves nothing)
    out = client.completions.create(model=served_name(server), prompt=prompt, max_tokens=40, temperature=0,
                                    presence_penalty=presence, frequency_penalty=frequency, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].logprobs.tokens == [hf.tokenizer.decode([i]) for i in expected]


def test_token_id_prompts_and_echo(server, client, hf):
    ids = hf.tokenizer("The river ran").input_ids
    by_ids = client.completions.create(model=served_name(server), prompt=ids, max_tokens=5, temperature=0)
    echoed = client.completions.create(model=served_name(server), prompt="The river ran", max_tokens=5,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "The river ran" + by_ids.choices[0].text
    assert by_ids.choices[0].text == hf.decode(hf(ids, 5))


def test_unknown_model_is_a_404_in_openais_shape(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.body == {"message": f"The model `gpt-4o` does not exist; this server serves "
                                         f"`{served_name(server)}`",
                              "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("suffix", "the end"), ("made_up", 1)])
def test_unsupported_fields_are_a_400_naming_them(server, client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served_name(server), messages=MESSAGES, extra_body={field: value})
    assert err.value.status_code == 400 and err.value.body["param"] == field
    assert err.value.body["message"].startswith(f"unsupported parameter \"{field}\"")


@pytest.mark.parametrize("body,param,message", [
    ({"temperature": 3}, "temperature", "\"temperature\" must be <= 2.0, not 3.0"),
    ({"max_tokens": 0}, "max_tokens", "\"max_tokens\" must be >= 1, not 0"),
    ({"presence_penalty": -2.5}, "presence_penalty", "\"presence_penalty\" must be >= -2.0, not -2.5"),
    ({"top_logprobs": 2}, "top_logprobs", "\"top_logprobs\" needs \"logprobs\": true"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "\"stream_options\" is only allowed with \"stream\": true"),
    ({"messages": []}, "messages", "\"messages\" must be a non-empty list of {\"role\", \"content\"} objects"),
])
def test_bad_chat_values_are_400s_in_openais_shape(server, body, param, message):
    resp = server.post(dict({"messages": MESSAGES}, **body), path="/v1/chat/completions")
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": None}}


def prompt_log_probs(hf, ids: list[int]) -> tuple[list[float | None], torch.Tensor]:
    with torch.no_grad():
        lp = torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), -1)
    return [None] + [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)], lp


def test_echo_with_logprobs_gives_the_prompts_log_probs_first(server, client, hf):
    prompt = "The river ran"
    ids = hf.tokenizer(prompt).input_ids
    out = client.completions.create(model=served_name(server), prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    generated = hf(prompt, 3)
    assert lp.tokens == [hf.tokenizer.decode([i], skip_special_tokens=True) for i in ids + generated]
    want, table = prompt_log_probs(hf, ids)
    got = lp.token_logprobs[:len(ids)]
    assert got[0] is None and all(abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:]))
    assert lp.top_logprobs[0] is None
    for i in range(1, len(ids)):  # each prompt position's two most likely tokens
        assert set(lp.top_logprobs[i]) == {hf.tokenizer.decode([t], skip_special_tokens=True)
                                           for t in table[i - 1].topk(2).indices.tolist()}
    assert lp.text_offset[len(ids)] == len(prompt) and out.choices[0].text.startswith(prompt)
    assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)])
    # streamed: the echoed prompt and its log-probs arrive with the first token
    chunks = list(client.completions.create(model=served_name(server), prompt=prompt, max_tokens=3, temperature=0,
                                            echo=True, logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[:len(ids)] == got


def test_decoder_input_details_on_invocations_fill_prefill(server, hf):
    body = server.post({"inputs": "The river ran", "parameters": {"max_new_tokens": 2, "details": True,
                                                                  "decoder_input_details": True}}).json()
    ids = hf.tokenizer("The river ran").input_ids
    want, _ = prompt_log_probs(hf, ids)
    prefill = body["details"]["prefill"]
    assert [t["id"] for t in prefill] == ids and prefill[0]["log_prob"] is None
    assert all(abs(t["log_prob"] - w) < 1e-4 for t, w in zip(prefill[1:], want[1:]))
    assert set(prefill[0]) == {"id", "text", "log_prob"}


def test_messages_on_invocations_answer_djls_chat_shape(server, client, hf):
    expected = hf.decode(hf(template_ids(hf, MESSAGES), 6))
    body = server.post({"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "model": "ignored"}).json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == expected
    resp = requests.post(server.url + "/invocations", stream=True, timeout=60,
                         json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True})
    assert resp.headers["Content-Type"].startswith("application/jsonlines")
    chunks = [json.loads(line) for line in resp.iter_lines() if line]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected


def test_min_p_reaches_the_sampler_on_every_route(server, client, hf):
    """min_p=1 keeps only the most likely token: sampling at a high temperature is then greedy."""
    prompt = "Once upon a time the mill"
    out = client.completions.create(model=served_name(server), prompt=prompt, max_tokens=8, temperature=1.8,
                                    seed=3, extra_body={"min_p": 1.0})
    lmi = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 8, "do_sample": True, "temperature": 1.8,
                                                         "min_p": 1.0, "details": True}}).json()
    assert ids_of(lmi) == hf(prompt, 8) and out.choices[0].text == hf.decode(hf(prompt, 8))


def test_logit_bias_and_min_tokens_change_the_tokens(server, client, hf):
    """OpenAI's logit_bias (through the SDK) forces a token; min_tokens (vLLM's extra parameter) and
    LMI's min_new_tokens hold back a stop id the greedy answer would end on at once."""
    done = client.completions.create(model=served_name(server), prompt="The river", max_tokens=3, temperature=0,
                                     logit_bias={"42": 100})
    assert done.choices[0].text == hf.decode([42, 42, 42])
    first = hf("The river", 1)[0]
    plain = server.post({"inputs": "The river", "parameters": {"max_new_tokens": 5, "stop_token_ids": [first],
                                                              "details": True}}).json()
    assert [t["id"] for t in plain["details"]["tokens"]] == [first]
    held = server.post({"inputs": "The river", "parameters": {"max_new_tokens": 5, "min_new_tokens": 3,
                                                             "stop_token_ids": [first], "details": True}}).json()
    ids = [t["id"] for t in held["details"]["tokens"]]
    assert len(ids) >= 3 and first not in ids[:3]
    chat = client.completions.create(model=served_name(server), prompt="The river", max_tokens=5, temperature=0,
                                     extra_body={"min_tokens": 3, "stop_token_ids": [first]})
    assert chat.usage.completion_tokens >= 3
    with pytest.raises(openai.BadRequestError, match="logit_bias names token 999999: this model's token ids are"):
        client.completions.create(model=served_name(server), prompt="Hi", max_tokens=2, logit_bias={"999999": 1})
    with pytest.raises(openai.BadRequestError, match=r"\"min_tokens\" \(9\) must not exceed the maximum number of new "
                                                     r"tokens \(2\)"):
        client.completions.create(model=served_name(server), prompt="Hi", max_tokens=2, extra_body={"min_tokens": 9})


def test_include_stop_str_in_output_and_skip_special_tokens(server, client, hf):
    """vLLM's text options: the stop string that ended the text kept in it; special tokens (EOS,
    forced here by logit_bias) written out when skip_special_tokens is false."""
    name = served_name(server)
    full = client.completions.create(model=name, prompt="The river", max_tokens=12, temperature=0).choices[0].text
    stop = full[4:7]
    at = full.find(stop)
    cut = client.completions.create(model=name, prompt="The river", max_tokens=12, temperature=0, stop=[stop])
    kept = client.completions.create(model=name, prompt="The river", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert (cut.choices[0].text, kept.choices[0].text) == (full[:at], full[:at + len(stop)])
    assert kept.choices[0].finish_reason == "stop"
    eos = hf.tokenizer.eos_token_id
    body = {"inputs": "The river", "parameters": {"max_new_tokens": 3, "logit_bias": {str(eos): 100}}}
    answers = [server.post(body).json()]
    body["parameters"]["skip_special_tokens"] = False
    answers.append(server.post(body).json())
    texts = [(a[0] if isinstance(a, list) else a)["generated_text"] for a in answers]
    assert texts == ["", hf.tokenizer.convert_ids_to_tokens(eos)]


def test_bad_words_keep_a_word_out_of_the_answer(server, client):
    name = served_name(server)
    full = client.completions.create(model=name, prompt="The river", max_tokens=8, temperature=0).choices[0].text
    word = full.split()[0]
    banned = client.completions.create(model=name, prompt="The river", max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [word]}).choices[0].text
    assert banned != full and banned.split()[:1] != [word], (full, banned)
    with pytest.raises(openai.BadRequestError, match="must be a list of at most 256 non-empty strings"):
        client.completions.create(model=name, prompt="Hi", max_tokens=2, extra_body={"bad_words": [""]})


def test_best_of_returns_the_n_choices_of_highest_cumulative_log_prob(server, client):
    """best_of 4, n 2, seeded: the same four generations as n 4 with that seed (copy k samples with
    seed + k), of which the two with the highest summed token log-probs come back, best first."""
    name = served_name(server)
    four = client.completions.create(model=name, prompt="The river", max_tokens=6, n=4, seed=7, temperature=1.0,
                                     logprobs=1)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(model=name, prompt="The river", max_tokens=6, n=2, best_of=4, seed=7,
                                     temperature=1.0)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match=r"\"best_of\" \(1\) must be at least \"n\" \(2\)"):
        client.completions.create(model=name, prompt="Hi", max_tokens=2, n=2, best_of=1)
    with pytest.raises(openai.BadRequestError, match="cannot stream"):
        client.completions.create(model=name, prompt="Hi", max_tokens=2, best_of=2, stream=True)
