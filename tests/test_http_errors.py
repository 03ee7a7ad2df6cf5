"""HTTP error paths against a fake engine behind the real ZeroMQ endpoint and engine client.

The fake engine answers by the prompt's first token: it fails (424), runs out of memory (507),
refuses (503 queue full) or echoes the prompt back. The Flask app is the real one.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

from engines.config import ENGINE_DYNAMIC, LmiConfig, ModelConfig, SchedulerConfig
from engines.process.endpoint import EngineEndpoint
from engines.protocol import STATE_LOADING, STATE_READY, Abort, HealthReply, Output
from engines.process.rundir import engine_socket_path
from handlers.app import build_app
from handlers.service import PING_SNAPSHOT_AGE_S, Service
from handlers.engine_client import EngineClient
from handlers.tokenizer import TextTokenizer


class FakeEngine:
    def __init__(self, tokenizer: TextTokenizer):
        self.state = STATE_READY
        self.publish = None
        self.codes = {tokenizer.encode(word)[1]: code for word, code in
                      (("fail", 424), ("oom", 507), ("busy", 503), ("silent", None))}
        self.silent_token = tokenizer.encode("silent")[1]

    def on_message(self, msg) -> None:
        if isinstance(msg, Abort):
            return
        first = msg.prompt_token_ids[1]
        if first == self.silent_token:
            return  # never answers: the handler's predict_timeout must fire
        code = self.codes.get(first)
        if code is not None:
            self.publish([Output(msg.request_id, [], finished=True, finish_reason="error", error_code=code,
                                 error=f"fake engine says {code}")])
        else:
            ids = msg.prompt_token_ids[1:]
            self.publish([Output(msg.request_id, ids, [-0.5] * len(ids), finished=True, finish_reason="length")])

    def health(self) -> HealthReply:
        return HealthReply(self.state)


def start_fake_engine(model_dir):
    """A FakeEngine behind a real endpoint in a fresh run dir: (engine, endpoint, run_dir, tokenizer)."""
    run_dir = tempfile.mkdtemp(prefix="lmi-test-")
    tokenizer = TextTokenizer(str(model_dir))
    engine = FakeEngine(tokenizer)
    endpoint = EngineEndpoint(engine_socket_path(run_dir), engine.on_message, engine.health)
    engine.publish = endpoint.publish
    endpoint.start()
    return engine, endpoint, run_dir, tokenizer


@pytest.fixture(scope="module")
def app_and_engine(tiny_model):
    engine, endpoint, run_dir, tokenizer = start_fake_engine(tiny_model)
    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model)),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_DYNAMIC, predict_timeout_s=1.0))
    engine.client = EngineClient(engine_socket_path(run_dir))
    app = build_app(Service(config, engine.client, tokenizer))
    yield app.test_client(), engine
    endpoint.close()
    os.rmdir(run_dir) if not os.listdir(run_dir) else None


@pytest.mark.parametrize("word,status,retry_after", [("fail", 424, None), ("oom", 507, None), ("busy", 503, "1")])
def test_engine_errors_map_to_status_codes(app_and_engine, word, status, retry_after):
    client, _ = app_and_engine
    resp = client.post("/invocations", json={"inputs": f"{word} now"})
    assert resp.status_code == status
    assert resp.get_json() == {"code": status, "type": {424: "ModelError", 507: "OutOfMemory",
                                                        503: "ServiceUnavailable"}[status],
                               "error": f"fake engine says {status}"}
    assert resp.headers.get("Retry-After") == retry_after


def test_an_engine_that_does_not_answer_times_out_with_424(app_and_engine):
    client, _ = app_and_engine
    resp = client.post("/invocations", json={"inputs": "silent please"})
    assert resp.status_code == 424
    assert "predict_timeout" in resp.get_json()["error"]


def test_a_good_request_after_errors_echoes(app_and_engine):
    client, _ = app_and_engine
    resp = client.post("/invocations", json={"inputs": "The river", "parameters": {"details": True}})
    assert resp.status_code == 200
    (body,) = resp.get_json()
    assert body["generated_text"] == "The river"
    assert [t["log_prob"] for t in body["details"]["tokens"]] == [-0.5] * body["details"]["generated_tokens"]


def test_ping_and_invocations_are_503_while_loading(app_and_engine):
    client, engine = app_and_engine
    engine.state = STATE_LOADING
    try:
        # /ping answers from a snapshot at most PING_SNAPSHOT_AGE_S old
        deadline = time.monotonic() + 2 * PING_SNAPSHOT_AGE_S
        while (ping := client.get("/ping")).status_code == 200:
            assert time.monotonic() < deadline, "/ping still 200 after the engine stopped being ready"
            time.sleep(0.05)
        assert ping.status_code == 503 and ping.get_json()["status"] == "loading"
        resp = client.post("/invocations", json={"inputs": "hello"})
        assert resp.status_code == 503 and "not ready" in resp.get_json()["error"]
        assert resp.headers["Retry-After"] == "1"
    finally:
        engine.state = STATE_READY
    assert client.get("/ping").status_code == 200


def test_ping_is_503_fast_when_the_engine_is_gone(tiny_model):
    run_dir = tempfile.mkdtemp(prefix="lmi-test-")  # nobody listens on this socket
    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model)))
    app = build_app(Service(config, EngineClient(engine_socket_path(run_dir)), TextTokenizer(str(tiny_model))))
    started = time.monotonic()
    resp = app.test_client().get("/ping")
    assert resp.status_code == 503 and resp.get_json()["engine"] == "not responding"
    assert time.monotonic() - started < 2.0


def test_a_stream_refused_before_its_first_token_is_a_503_with_retry_after(app_and_engine, tiny_model):
    """The status line waits for the first token: a refused stream is not a 200 with an error line."""
    from engines.config import ENGINE_PAGED

    _, engine = app_and_engine
    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model)),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, predict_timeout_s=1.0))
    streaming = build_app(Service(config, engine.client, TextTokenizer(str(tiny_model)))).test_client()
    resp = streaming.post("/invocations", json={"inputs": "busy now", "stream": True})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert resp.get_json() == {"code": 503, "type": "ServiceUnavailable", "error": "fake engine says 503"}
    ok = streaming.post("/invocations", json={"inputs": "The river", "stream": True})
    assert ok.status_code == 200 and ok.mimetype == "application/jsonlines"
    assert json.loads(ok.get_data(as_text=True).splitlines()[-1])["generated_text"] == "The river"
