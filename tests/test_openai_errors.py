"""OpenAI-shaped errors from the real app behind a fake engine (tests/test_http_errors.py's)."""

from __future__ import annotations

import os

import pytest

from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig, ServerConfig
from engines.process.rundir import engine_socket_path
from handlers.app import build_app
from handlers.service import Service
from handlers.chat_template import ChatTemplate
from handlers.engine_client import EngineClient
from tests.test_http_errors import start_fake_engine


def make_app(model_dir, template):
    _, endpoint, run_dir, tokenizer = start_fake_engine(model_dir)
    config = LmiConfig(model=ModelConfig(local_dir=str(model_dir)),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, predict_timeout_s=1.0),
                       server=ServerConfig(served_model_name="tiny"))
    app = build_app(Service(config, EngineClient(engine_socket_path(run_dir)), tokenizer, chat_template=template))
    return app.test_client(), endpoint, run_dir


@pytest.fixture(scope="module")
def client(tiny_model):
    test_client, endpoint, run_dir = make_app(tiny_model, ChatTemplate.load(str(tiny_model)))
    yield test_client
    endpoint.close()
    os.rmdir(run_dir) if not os.listdir(run_dir) else None


@pytest.mark.parametrize("word,status,kind", [("fail", 424, "model_error"), ("oom", 507, "server_error"),
                                              ("busy", 503, "service_unavailable_error")])
def test_engine_errors_keep_their_status_in_openais_shape(client, word, status, kind):
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": f"{word} now"})
    assert resp.status_code == status
    assert resp.get_json() == {"error": {"message": f"fake engine says {status}", "type": kind, "param": None,
                                         "code": None}}


def test_an_error_before_the_first_chunk_keeps_its_status_when_streaming(client):
    resp = client.post("/v1/completions", json={"prompt": "fail now", "stream": True})
    assert resp.status_code == 424 and resp.get_json()["error"]["type"] == "model_error"


def test_unknown_v1_route_is_openai_shaped(client):
    resp = client.get("/v1/nope")
    assert resp.status_code == 404 and resp.get_json()["error"]["type"] == "invalid_request_error"


def test_a_model_without_a_chat_template_answers_chat_with_a_400(tiny_model):
    test_client, endpoint, _ = make_app(tiny_model, None)
    try:
        resp = test_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400
        assert resp.get_json()["error"]["message"].startswith("this model has no chat template")
        resp = test_client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400 and resp.get_json()["error"].startswith("this model has no chat template")
        assert test_client.post("/v1/completions", json={"prompt": "The river"}).status_code == 200
    finally:
        endpoint.close()
