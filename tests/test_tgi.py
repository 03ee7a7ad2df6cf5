"""TGI's routes on a rolling engine: as raw HTTP against TGI's exact shapes, and through TGI's own
`text-generation` client (installed with --no-deps by the test command: it pins huggingface-hub<1.0,
which this project's transformers cannot use; the client itself runs with the newer one)."""

from __future__ import annotations

import json

import pytest
import requests

from text_generation import Client
from text_generation.errors import ValidationError

from tests.support import ids_of, running_server

PROPERTIES = "engine=Python\noption.rolling_batch=scheduler\noption.dtype=fp32\n"
PROMPT = "The river ran"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("tgi"), PROPERTIES, tiny_model)


def test_generate_with_details_matches_invocations(server, hf):
    body = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}},
                       path="/generate").json()
    lmi = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}}).json()
    assert body["generated_text"] == lmi["generated_text"] == hf.decode(hf(PROMPT, 5))
    assert body["details"] == {
        "finish_reason": "length", "generated_tokens": 5, "seed": None, "prefill": [],
        "tokens": [{"id": t["id"], "text": t["text"], "logprob": t["log_prob"], "special": False}
                   for t in lmi["details"]["tokens"]]}
    assert [t["id"] for t in body["details"]["tokens"]] == ids_of(lmi)


def test_generate_without_details_is_just_the_text(server, hf):
    body = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, path="/generate").json()
    assert body == {"generated_text": hf.decode(hf(PROMPT, 3))}


def test_generate_stream_sends_tgi_events(server, hf):
    resp = requests.post(server.url + "/generate_stream", stream=True, timeout=60,
                         json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}})
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[len(b"data: "):]) for line in resp.iter_lines() if line]
    expected = hf(PROMPT, 4)
    assert [e["token"]["id"] for e in events] == expected and [e["index"] for e in events] == [1, 2, 3, 4]
    assert all(set(e["token"]) == {"id", "text", "logprob", "special"} for e in events)
    assert [e["generated_text"] for e in events[:-1]] == [None] * 3 and events[-1]["generated_text"] == hf.decode(expected)
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 4, "seed": None}


def test_info(server):
    info = requests.get(server.url + "/info", timeout=5).json()
    assert info["model_id"] == "tiny-llama" and info["max_total_tokens"] == 1024 and info["max_best_of"] == 1


@pytest.mark.parametrize("name,value", [("best_of", 2), ("watermark", True)])
def test_tgi_parameters_we_lack_are_a_400(server, name, value):
    resp = server.post({"inputs": PROMPT, "parameters": {name: value}}, path="/generate")
    assert resp.status_code == 400 and resp.json()["error"].startswith(f"\"parameters.{name}\" is not supported")
    assert resp.json()["error_type"] == "validation"  # TGI's error shape


def test_the_text_generation_client_generates_with_details(server, hf):
    expected = hf(PROMPT, 6)
    resp = Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=6)
    assert resp.generated_text == hf.decode(expected)
    assert [t.id for t in resp.details.tokens] == expected
    assert resp.details.finish_reason == "length" and resp.details.generated_tokens == 6
    assert all(t.logprob is not None and t.logprob <= 0 for t in resp.details.tokens)


def test_the_text_generation_client_streams(server, hf):
    expected = hf(PROMPT, 5)
    events = list(Client(server.url, timeout=60).generate_stream(PROMPT, max_new_tokens=5))
    assert [e.token.id for e in events] == expected
    assert [e.generated_text for e in events[:-1]] == [None] * 4 and events[-1].generated_text == hf.decode(expected)
    assert events[-1].details.generated_tokens == 5


def test_an_adapter_id_is_a_404_naming_it(server):
    """TGI's LoRA parameter: not served, so not answered by the base model under the adapter's name."""
    resp = server.post({"inputs": PROMPT, "parameters": {"adapter_id": "math-lora", "max_new_tokens": 2}},
                       path="/generate")
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"].startswith('"parameters.adapter_id": no LoRA adapter named "math-lora"')
    # an empty adapter_id asks for the base model
    assert server.post({"inputs": PROMPT, "parameters": {"adapter_id": "", "max_new_tokens": 2}},
                       path="/generate").status_code == 200


def test_the_text_generation_client_gets_a_clear_error_for_what_we_lack(server):
    with pytest.raises(ValidationError, match="watermark"):
        Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=2, watermark=True)


def prompt_log_probs(hf, ids: list[int]) -> list[float | None]:
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), -1)
    return [None] + [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_the_text_generation_client_gets_the_prompts_log_probs(server, hf):
    resp = Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=3, decoder_input_details=True)
    ids = hf.tokenizer(PROMPT)["input_ids"]
    assert [t.id for t in resp.details.prefill] == ids and [t.id for t in resp.details.tokens] == hf(PROMPT, 3)
    assert [t.text for t in resp.details.prefill] == [hf.tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    want = prompt_log_probs(hf, ids)
    got = [t.logprob for t in resp.details.prefill]
    assert got[0] is None and all(abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:]))


def test_decoder_input_details_with_a_stream_is_a_400(server):
    resp = server.post({"inputs": PROMPT, "parameters": {"decoder_input_details": True, "details": True}},
                       path="/generate_stream")
    assert resp.status_code == 400 and resp.json()["error"] == \
        "\"parameters.decoder_input_details\" cannot be used with streaming"


def test_truncate_keeps_the_last_prompt_tokens(server, hf):
    ids = hf.tokenizer("Once upon a time the river ran")["input_ids"]
    body = server.post({"inputs": "Once upon a time the river ran",
                        "parameters": {"truncate": 3, "max_new_tokens": 4, "details": True,
                                       "decoder_input_details": True}}, path="/generate").json()
    assert [t["id"] for t in body["details"]["prefill"]] == ids[-3:]
    assert [t["id"] for t in body["details"]["tokens"]] == hf(ids[-3:], 4)


def test_post_slash_is_tgi_compat_generate(server, hf):
    body = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, path="/").json()
    assert body == [{"generated_text": hf.decode(hf(PROMPT, 3))}]


@pytest.fixture(scope="module")
def tgi_compat(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("tgi-compat"), PROPERTIES + "option.tgi_compat=true\n",
                              tiny_model)


def test_tgi_compat_makes_invocations_answer_as_tgi(tgi_compat, hf):
    """DJL's option.tgi_compat: /invocations takes TGI's requests and answers in TGI's shapes, so the
    text-generation client works against a SageMaker endpoint's route."""
    expected = hf(PROMPT, 4)
    client = Client(tgi_compat.url + "/invocations", timeout=60)
    resp = client.generate(PROMPT, max_new_tokens=4)
    assert resp.generated_text == hf.decode(expected) and [t.id for t in resp.details.tokens] == expected
    assert [e.token.id for e in client.generate_stream(PROMPT, max_new_tokens=4)] == expected
    raw = tgi_compat.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert raw.status_code == 200 and raw.json() == [{"generated_text": hf.decode(expected[:2])}]
