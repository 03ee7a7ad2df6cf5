"""The tokenizer routes on a real server: vLLM's /tokenize and /detokenize, TGI's /tokenize.

Oracles: transformers' AutoTokenizer on the same model directory (ids, offsets, token strings, the
chat template through apply_chat_template), and the chat route itself: the ids /tokenize gives for a
conversation, sent to /v1/completions, generate what /v1/chat/completions generates for it.
"""

from __future__ import annotations

import pytest
import requests
from transformers import AutoTokenizer

from handlers.errors import HttpError
from handlers.routes.tokenize import open_final_message, token_ids
from tests.support import running_server

PROPERTIES = "engine=Python\noption.rolling_batch=scheduler\noption.dtype=fp32\noption.max_rolling_batch_size=4\n"
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "The river ran"}]
PREFILLED = MESSAGES + [{"role": "assistant", "content": "It ran past the mill"}]
TEXTS = ["The river ran quietly past the old mill.", "Café  crème — naïve ✓", "emoji 🚀 and 中文 mixed"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("tokenize"), PROPERTIES, tiny_model)


@pytest.fixture(scope="module")
def hf_tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def tokenize(server, body: dict) -> dict:
    resp = server.post(body, "/tokenize")
    assert resp.status_code == 200, resp.text
    return resp.json()


def template_ids(hf_tok, messages, **kwargs) -> list[int]:
    # transformers 5: tokenize=True returns a BatchEncoding, not a list
    return list(hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_gives_the_tokenizers_ids_with_or_without_special_tokens(server, hf_tok, text):
    out = tokenize(server, {"prompt": text})
    max_len = requests.get(server.url + "/info", timeout=5).json()["max_total_tokens"]
    assert out == {"count": len(hf_tok(text).input_ids), "max_model_len": max_len,
                   "tokens": hf_tok(text).input_ids, "token_strs": None}
    bare = tokenize(server, {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert bare["tokens"] == hf_tok(text, add_special_tokens=False).input_ids
    assert bare["token_strs"] == hf_tok.convert_ids_to_tokens(bare["tokens"])


def test_a_chat_gives_the_templates_ids_and_the_prompt_the_chat_route_sends(server, hf_tok):
    ids = template_ids(hf_tok, MESSAGES, add_generation_prompt=True)
    out = tokenize(server, {"model": "tiny-llama", "messages": MESSAGES})
    assert out["tokens"] == ids and out["count"] == len(ids)
    chat = server.post({"messages": MESSAGES, "max_tokens": 4, "temperature": 0}, "/v1/chat/completions").json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    # the same ids as a token prompt generate what the chat route generated: the same prompt reached the engine
    completion = server.post({"prompt": ids, "max_tokens": 4, "temperature": 0}, "/v1/completions").json()
    assert completion["choices"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_chat_options_render_as_apply_chat_template_does(server, hf_tok):
    no_prompt = tokenize(server, {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_prompt["tokens"] == template_ids(hf_tok, MESSAGES, add_generation_prompt=False)
    prefilled = tokenize(server, {"messages": PREFILLED, "continue_final_message": True, "return_token_strs": True})
    expected = template_ids(hf_tok, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert prefilled["tokens"] == expected and prefilled["token_strs"] == hf_tok.convert_ids_to_tokens(expected)
    specials = tokenize(server, {"messages": MESSAGES, "add_special_tokens": True})
    rendered = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert specials["tokens"] == hf_tok(rendered, add_special_tokens=True).input_ids


def test_detokenize_round_trips_and_keeps_special_tokens(server, hf_tok):
    for text in TEXTS:
        ids = tokenize(server, {"prompt": text, "add_special_tokens": False})["tokens"]
        assert server.post({"tokens": ids}, "/detokenize").json() == {"prompt": text}
    ids = tokenize(server, {"messages": MESSAGES})["tokens"]
    assert server.post({"tokens": ids}, "/detokenize").json()["prompt"] == hf_tok.decode(ids)
    assert server.post({"tokens": []}, "/detokenize").json() == {"prompt": ""}


@pytest.mark.parametrize("text", TEXTS)
def test_tgi_form_gives_each_tokens_offsets_into_the_input(server, hf_tok, text):
    tokens = server.post({"inputs": text, "parameters": {"max_new_tokens": 5}}, "/tokenize").json()
    expected = hf_tok(text, return_offsets_mapping=True)
    assert [t["id"] for t in tokens] == expected.input_ids
    assert [(t["start"], t["stop"]) for t in tokens] == [tuple(o) for o in expected.offset_mapping]
    assert all(t["text"] == text[t["start"]:t["stop"]] and set(t) == {"id", "text", "start", "stop"} for t in tokens)
    last = server.post({"inputs": text, "parameters": {"truncate": 3}}, "/tokenize").json()
    assert last == tokens[-3:]


BAD = [  # (path, body, what the 400 names)
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"prompt": "a", "inputs": "a"}, "inputs"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"messages": "hello"}, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
    ("/tokenize", {"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"inputs": ["a", "b"]}, "inputs"),
    ("/tokenize", {"inputs": ""}, "inputs"),
    ("/tokenize", {"inputs": "a", "parameters": {"truncate": 0}}, "truncate"),
    ("/tokenize", {"inputs": "a", "parameters": "fast"}, "parameters"),
    ("/tokenize", {"inputs": "a", "add_special_tokens": None, "prompt_name": "q"}, "prompt_name"),
    ("/tokenize", {"model": 3, "prompt": "a"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [1, 99999, 2**40]}, f"99999, {2**40}"),
    ("/detokenize", {"tokens": [1], "prompt": "a"}, "prompt"),
]


@pytest.mark.parametrize("path, body, field", BAD, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD)])
def test_bad_bodies_are_400s_naming_the_field(server, path, body, field):
    resp = server.post(body, path)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == 400 and field in resp.json()["error"], resp.json()


def test_an_unknown_model_is_a_404_and_a_body_that_is_not_json_a_400(server):
    resp = server.post({"model": "other", "prompt": "a"}, "/tokenize")
    assert resp.status_code == 404 and "other" in resp.json()["error"] and "tiny-llama" in resp.json()["error"]
    resp = requests.post(server.url + "/detokenize", data=b"[1, 2", timeout=5)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]


def test_open_final_message_cuts_as_transformers_does():
    text = "<|user|>\nhi</s>\n<|assistant|>\nIt ran </s>\n"
    assert open_final_message(text, "It ran ") == "<|user|>\nhi</s>\n<|assistant|>\nIt ran "  # spacing kept
    trimmed = "<|user|>\nhi</s>\n<|assistant|>\nIt ran</s>\n"
    assert open_final_message(trimmed, "  It ran  ") == "<|user|>\nhi</s>\n<|assistant|>\nIt ran"  # trimmed by it
    assert open_final_message("a hi b hi c", "hi") == "a hi b hi"  # the last occurrence
    with pytest.raises(HttpError) as err:
        open_final_message(text, "not there")
    assert err.value.code == 400 and err.value.param == "continue_final_message"


def test_token_ids_name_the_first_bad_id():
    assert token_ids([0, 5, 2**40]) == [0, 5, 2**40]  # (the vocabulary is checked after)
    for bad, where in (([1, None], "[1]"), ([3, -2], "[1]"), ([False], "[0]")):
        with pytest.raises(HttpError) as err:
            token_ids(bad)
        assert err.value.param == "tokens" and where in err.value.message
