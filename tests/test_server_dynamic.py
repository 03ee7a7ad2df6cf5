"""End to end: `lmi serve` as a real subprocess (launcher + engine + gunicorn) with dynamic batching.

The oracle is HF `generate` on the same tiny model in this process.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest
import requests

from container.model_maker import corpus_lines
from engines.config import ServerConfig
from tests.support import Server, ids_of, running_server, wait_for

MAX_REQUEST_SIZE = 100_000
PROPERTIES = f"""
engine=Python
option.rolling_batch=disable
batch_size=4
max_batch_delay=500
option.dtype=fp32
max_request_size={MAX_REQUEST_SIZE}
"""


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("dyn"), PROPERTIES, tiny_model)


PROMPTS = [line[: 8 + 9 * i] for i, line in enumerate(corpus_lines()[:8])]


def _batches(server: Server) -> int:
    """Batches run so far, asked of the engine now (/ping answers from a snapshot up to 1 s old)."""
    text = requests.get(server.url + "/metrics", timeout=5).text
    return int(float(re.search(r"^lmi_engine_steps_total ([0-9.e+]+)$", text, re.M).group(1)))


def test_ping_goes_from_503_to_200(server):
    assert server.ping_statuses[-1] == 200
    assert 503 in server.ping_statuses, server.ping_statuses
    first_ok = server.ping_statuses.index(200)
    assert all(s == 503 for s in server.ping_statuses[:first_ok])
    body = requests.get(server.url + "/ping", timeout=5).json()
    assert body["status"] == "healthy" and body["engine_kind"] == "dynamic"


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"len{len(p)}" for p in PROMPTS])
def test_greedy_single_input_equals_hf_generate(server, hf, prompt):
    resp = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True}})
    assert resp.status_code == 200, resp.text
    (body,) = resp.json()  # dynamic batching answers a list, one object per input (DJL's shape)
    expected = hf(prompt, 24)
    assert ids_of(body) == expected
    assert body["generated_text"] == "".join(t["text"] for t in body["details"]["tokens"])
    assert body["generated_text"] == hf.decode(expected)
    assert body["details"]["generated_tokens"] == len(expected)
    assert body["details"]["finish_reason"] in ("length", "eos_token")


def test_list_input_answers_each_prompt_in_order(server, hf):
    prompts = PROMPTS[:3]
    resp = server.post({"inputs": prompts, "parameters": {"max_new_tokens": 12, "details": True}})
    assert resp.status_code == 200, resp.text
    bodies = resp.json()
    assert [ids_of(b) for b in bodies] == [hf(p, 12) for p in prompts]
    assert [b["details"]["inputs"] for b in bodies] == prompts


def test_default_response_is_generated_text_only(server, hf):
    resp = server.post({"inputs": PROMPTS[0]})
    assert resp.status_code == 200
    assert resp.json() == [{"generated_text": hf.decode(hf(PROMPTS[0], 30))}]  # max_new_tokens default 30


def test_return_full_text_prepends_the_prompt(server, hf):
    resp = server.post({"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 5, "return_full_text": True}})
    assert resp.json()[0]["generated_text"] == PROMPTS[1] + hf.decode(hf(PROMPTS[1], 5))


def test_four_concurrent_requests_run_as_one_batch(server, hf):
    before = _batches(server)
    prompts = PROMPTS[2:6]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(server.post, {"inputs": p, "parameters": {"max_new_tokens": 10, "details": True}},
                               headers={"X-Request-Id": f"four-{i}"}) for i, p in enumerate(prompts)]
        bodies = [f.result().json()[0] for f in futures]
    assert _batches(server) == before + 1
    assert [ids_of(b) for b in bodies] == [hf(p, 10) for p in prompts]
    # the engine knows requests by the server's ids; the log ties each to the client's X-Request-Id
    log = server.log()
    ours = [re.search(rf"\[([0-9a-f]+) client-id='four-{i}'\]", log).group(1) for i in range(4)]
    batch_lines = [line for line in log.splitlines() if re.search(r"batch \d+: 4 prompts", line)]
    assert any(all(f"{rid}-0" in line for rid in ours) for line in batch_lines), batch_lines


def test_different_parameters_go_to_separate_batches(server, hf):
    before = _batches(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(server.post, {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6, "details": True}})
        b = pool.submit(server.post, {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 9, "details": True}})
        body_a, body_b = a.result().json()[0], b.result().json()[0]
    assert _batches(server) == before + 2
    assert ids_of(body_a) == hf(PROMPTS[0], 6)
    assert ids_of(body_b) == hf(PROMPTS[1], 9)


def test_stop_sequence_trims_text_and_reports_it(server, hf):
    full = hf.decode(hf(PROMPTS[3], 20))
    stop = full[5:9]
    resp = server.post({"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 20, "details": True,
                                                             "stop_sequences": [stop]}})
    body = resp.json()[0]
    assert body["generated_text"] == full[: full.index(stop)]
    assert body["details"]["finish_reason"] == "stop_sequence"


def test_request_id_is_echoed(server):
    resp = server.post({"inputs": "hi", "parameters": {"max_new_tokens": 2}}, headers={"X-Request-Id": "rid-123"})
    assert resp.headers["X-Request-Id"] == "rid-123"
    # gunicorn writes the access line after the response has gone out: wait for it
    wait_for(lambda: "rid=rid-123" in server.log(), 10, "the access log line with the client's id")
    assert "client-id='rid-123'" in server.log()  # logged beside our own id (docs/api.md)
    assert len(requests.get(server.url + "/ping").headers["X-Request-Id"]) == 32


BAD_INPUTS = [
    ("invalid-json", b"{not json", 400, "not valid JSON"),
    ("not-an-object", b"[1, 2]", 400, "must be a JSON object"),
    ("empty-body", b"", 400, "body is empty"),
    ("missing-inputs", {"parameters": {}}, 400, 'missing "inputs"'),
    ("inputs-number", {"inputs": 5}, 400, '"inputs" must be a string or a list of strings'),
    ("inputs-list-of-numbers", {"inputs": ["a", 3]}, 400, '"inputs"[1] must be a string'),
    ("inputs-empty-list", {"inputs": []}, 400, "empty list"),
    ("parameters-not-object", {"inputs": "a", "parameters": [1]}, 400, '"parameters" must be a JSON object'),
    ("max-new-tokens-negative", {"inputs": "a", "parameters": {"max_new_tokens": -1}}, 400,
     '"parameters.max_new_tokens" must be >= 1'),
    ("max-new-tokens-string", {"inputs": "a", "parameters": {"max_new_tokens": "x"}}, 400,
     '"parameters.max_new_tokens" must be an integer'),
    ("max-new-tokens-bool", {"inputs": "a", "parameters": {"max_new_tokens": True}}, 400, "must be an integer"),
    ("temperature-negative", {"inputs": "a", "parameters": {"do_sample": True, "temperature": -0.5}}, 400,
     '"parameters.temperature" must be >= 0.0'),
    ("top-p-above-one", {"inputs": "a", "parameters": {"top_p": 1.5}}, 400, '"parameters.top_p" must be <= 1.0'),
    ("do-sample-string", {"inputs": "a", "parameters": {"do_sample": "yes"}}, 400, '"parameters.do_sample" must be true'),
    ("stop-not-strings", {"inputs": "a", "parameters": {"stop_sequences": [1]}}, 400, "stop_sequences"),
    ("stream-with-dynamic", {"inputs": "a", "stream": True}, 400, "streaming is not supported with dynamic batching"),
    ("chat-with-dynamic", {"messages": [{"role": "user", "content": "hi"}]}, 400, "chat requests"),
    ("too-long", {"inputs": "word " * 600, "parameters": {"max_new_tokens": 1000}}, 400,
     "exceeds the model's maximum length of 1024 tokens"),
    ("oversized-body", {"inputs": "x" * (MAX_REQUEST_SIZE + 10)}, 413, "exceeds max_request_size (100000 bytes)"),
    # a LoRA adapter asked for (DJL's top-level field, TGI's parameter): 404, never the base model's answer
    ("adapters-name", {"inputs": "a", "adapters": "my-adapter"}, 404,
     '"adapters": no LoRA adapter named "my-adapter": this server serves the base model only'),
    ("adapters-list", {"inputs": ["a", "b"], "adapters": ["x", "y"]}, 404, 'no LoRA adapter named "x", "y"'),
    ("adapter-id", {"inputs": "a", "parameters": {"adapter_id": "tgi-adapter"}}, 404,
     '"parameters.adapter_id": no LoRA adapter named "tgi-adapter"'),
]


@pytest.mark.parametrize("body,status,message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_json_error_and_server_keeps_serving(server, body, status, message):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = requests.post(server.url + "/invocations", data=data, headers={"Content-Type": "application/json"},
                         timeout=30)
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"] == "application/json"
    err = resp.json()
    assert err["code"] == status and message in err["error"], err
    assert requests.get(server.url + "/ping", timeout=5).status_code == 200


def test_still_serving_after_bad_inputs(server, hf):
    resp = server.post({"inputs": PROMPTS[4], "parameters": {"max_new_tokens": 8, "details": True}})
    assert resp.status_code == 200 and ids_of(resp.json()[0]) == hf(PROMPTS[4], 8)


def test_unknown_route_and_method_are_json(server):
    assert requests.get(server.url + "/nope").json()["code"] == 404
    resp = requests.get(server.url + "/invocations")
    assert resp.status_code == 405 and resp.json()["code"] == 405


def test_predictions_route_and_text_plain(server, hf):
    resp = requests.post(server.url + "/predictions/tiny-llama", data=PROMPTS[0].encode(),
                         headers={"Content-Type": "text/plain"}, timeout=30)
    assert resp.status_code == 200
    assert resp.json() == [{"generated_text": hf.decode(hf(PROMPTS[0], 30))}]
    # a model this server does not serve is a 404 naming the one it does (never the served model's text)
    resp = requests.post(server.url + "/predictions/tiny", data=PROMPTS[0].encode(),
                         headers={"Content-Type": "text/plain"}, timeout=30)
    assert resp.status_code == 404
    assert resp.json() == {"code": 404, "type": "NotFound",
                           "error": "Model or workflow not found: tiny; this server serves tiny-llama"}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "hi"})])
def test_openai_generation_routes_are_a_clear_400_with_dynamic_batching(server, path, body):
    resp = server.post(body, path=path)
    assert resp.status_code == 400
    assert resp.json() == {"error": {
        "message": "the OpenAI routes need a rolling-batch engine; this server runs dynamic batching "
                   "(batch_size>1 or option.rolling_batch=disable): use /invocations",
        "type": "invalid_request_error", "param": None, "code": None}}
    assert requests.get(server.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "tiny-llama"


def test_presence_penalty_is_a_400_with_dynamic_batching(server):
    resp = server.post({"inputs": "hi", "parameters": {"presence_penalty": 0.5}})
    assert resp.status_code == 400 and "need a rolling-batch engine" in resp.json()["error"]


def test_ping_is_logged_only_when_its_answer_changes(server):
    """A health check every few seconds must not flood the log (issue: every /ping at INFO)."""
    for _ in range(6):
        assert requests.get(server.url + "/ping", timeout=5).status_code == 200
    resp = server.post({"inputs": "hi", "parameters": {"max_new_tokens": 2}}, headers={"X-Request-Id": "after-pings"})
    assert resp.status_code == 200
    wait_for(lambda: "rid=after-pings" in server.log(), 10, "the access log line of the request after the pings")
    ok_lines = [line for line in server.log().splitlines() if '"GET /ping HTTP/1.1" 200' in line]
    assert 1 <= len(ok_lines) <= ServerConfig().http_workers, ok_lines  # the first 200 of each worker, no more


@pytest.mark.parametrize("params,message", [
    ({"details": True, "decoder_input_details": True}, "the prompt's log-probabilities (decoder_input_details"),
    ({"details": True, "top_n_tokens": 2}, "top_n_tokens needs a rolling-batch engine")])
def test_what_hf_generate_cannot_give_is_a_400_with_dynamic_batching(server, params, message):
    resp = server.post({"inputs": "hi", "parameters": params})
    assert resp.status_code == 400 and resp.json()["error"].startswith(message)
