"""Custom handlers (DJL's model.py with handle(inputs)): the djl_python API, the entry-point rules, and
real servers running a JSON echo handler (with a requirements.txt), one that calls transformers itself
(greedy tokens equal to HF generate) and a broken one (the start fails with its traceback's last line)."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import requests

from container import config as cfgmod
from container.keys import ConfigError
from djl_python import Input, Output
from djl_python.pair_list import PairList
from engines.config import ENGINE_HANDLER, ENGINE_PAGED

ECHO = '''
import lmi_handler_dep  # installed from requirements.txt at start
from djl_python import Input, Output

warm_up = {}


def handle(inputs: Input):
    if inputs.is_empty():  # the warm-up call: the model's properties
        warm_up.update(inputs.get_properties())
        return None
    if inputs.get_property("content-type").startswith("text/"):
        return Output().add(inputs.get_as_string().upper())
    body = inputs.get_as_json()
    if body.get("fail"):
        raise ValueError("asked to fail")
    if body.get("nothing"):
        return None
    out = Output()
    if body.get("item_error"):
        for i, _ in enumerate(inputs.get_batches()):
            out.error("the item is wrong", code=400, message="validation", batch_index=i)
        return out
    out.add_property("X-Handler", "echo")
    out.add_as_json({"echo": body, "greeting": warm_up.get("my_greeting"), "tp": warm_up.get("tensor_parallel_degree"),
                     "model_dir": warm_up.get("model_dir"), "dep": lmi_handler_dep.VALUE,
                     "accept": inputs.get_property("ACCEPT"), "batch": len(inputs.get_batches())})
    if body.get("code"):
        out.set_code(body["code"]).set_message("as asked")
    return out
'''

CALLS_TRANSFORMERS = '''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from djl_python import Input, Output

model = tokenizer = None


def handle(inputs: Input):
    global model, tokenizer
    if model is None:
        path = inputs.get_properties()["model_dir"]
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if inputs.is_empty():
        return None
    data = inputs.get_as_json()
    enc = tokenizer(data["inputs"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=data["parameters"]["max_new_tokens"], do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    ids = out[0, enc["input_ids"].shape[1]:].tolist()
    return Output().add_as_json({"generated_text": tokenizer.decode(ids, skip_special_tokens=True), "ids": ids})
'''


def write_wheel(folder: Path) -> Path:
    """A one-module wheel (lmi_handler_dep, VALUE = 42), built by hand: nothing is downloaded."""
    files = {"lmi_handler_dep/__init__.py": b"VALUE = 42\n",
             "lmi_handler_dep-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: lmi-handler-dep\nVersion: 1.0\n",
             "lmi_handler_dep-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                                   b"Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + "lmi_handler_dep-1.0.dist-info/RECORD,,\n"
    path = folder / "lmi_handler_dep-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("lmi_handler_dep-1.0.dist-info/RECORD", record)
    return path


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    from tests.support import running_server

    model = tmp_path_factory.mktemp("echo-model")
    (model / "model.py").write_text(ECHO)
    wheel = write_wheel(model)
    (model / "requirements.txt").write_text(f"./{wheel.name}\n")
    yield from running_server(tmp_path_factory.mktemp("echo"), "option.my_greeting=hello\njob_queue_size=8\n"
                                                                 "option.served_model_name=echo\n", model)


def test_the_echo_handler_serves_json_text_codes_and_errors(echo_server):
    resp = echo_server.post({"x": [1, 2]}, headers={"Accept": "application/json"})
    assert resp.status_code == 200 and resp.headers["X-Handler"] == "echo"
    assert resp.headers["Content-Type"].startswith("application/json")
    body = resp.json()
    assert body == {"echo": {"x": [1, 2]}, "greeting": "hello", "tp": None, "model_dir": body["model_dir"], "dep": 42,
                    "accept": "application/json", "batch": 1}
    assert Path(body["model_dir"]).is_dir()
    resp = requests.post(echo_server.url + "/predictions/echo", data="shout", headers={"Content-Type": "text/plain"},
                         timeout=30)
    assert resp.status_code == 200 and resp.text == "SHOUT"
    assert echo_server.post({"code": 201}).status_code == 201
    failed = echo_server.post({"fail": True})
    assert failed.status_code == 424
    assert failed.json() == {"code": 424, "message": "prediction failure", "error": "ValueError: asked to fail"}
    item = echo_server.post({"item_error": True})
    assert item.status_code == 400 and item.json() == {"code": 400, "message": "validation",
                                                       "error": "the item is wrong"}
    assert echo_server.post({"nothing": True}).status_code == 204
    assert echo_server.post({"x": 1}).status_code == 200  # the engine went on after the failure


def test_only_invocations_and_health_routes_are_served_with_a_custom_handler(echo_server):
    assert requests.get(echo_server.url + "/ping", timeout=10).status_code == 200
    assert "lmi_engine_ready" in requests.get(echo_server.url + "/metrics", timeout=10).text
    resp = requests.post(echo_server.url + "/v1/chat/completions", json={"messages": []}, timeout=10)
    assert resp.status_code == 404 and "custom handler" in resp.json()["error"]["message"]
    assert requests.post(echo_server.url + "/generate", json={"inputs": "x"}, timeout=10).status_code == 404


def test_a_handler_that_calls_transformers_gives_hf_greedy_text(tiny_model, hf, tmp_path, start_server):
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_model.iterdir():
        (model / path.name).symlink_to(path)
    (model / "model.py").write_text(CALLS_TRANSFORMERS)
    server = start_server(None, model)
    prompt = "The river ran"
    body = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 8}}).json()
    want = hf(prompt, 8)
    assert body["ids"] == want and body["generated_text"] == hf.decode(want)


def test_a_broken_handler_fails_at_start_with_its_tracebacks_last_line(tmp_path, start_server):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.py").write_text("import os\n\ndef load():\n    raise ValueError('no weights in ' + os.sep)\n\n"
                                    "load()\n\ndef handle(inputs):\n    return None\n")
    server = start_server(None, model, wait=False)
    assert server.proc.wait(timeout=120) != 0
    last = [line for line in server.log().splitlines() if line.strip()][-1]
    assert "custom handler model.py failed at import: ValueError: no weights in /" in last, server.log()


# -- the djl_python API ------------------------------------------------------------------------------------------

def test_input_reads_properties_content_and_batches_as_djl_documents():
    single = Input({"Content-Type": "application/json"}, PairList(pair_list=[("data", b'{"a": 1}')]))
    assert single.get_property("content-type") == "application/json" and single.get_data() == {"a": 1}
    assert single.get_as_json() == {"a": 1} and single.get_batches() == [single] and not single.is_empty()
    assert Input().is_empty() and Input().get_as_bytes() is None
    with pytest.raises(KeyError):
        single.get_as_bytes("missing")
    batch = Input({"batch_size": "2", "batch_000_Content-Type": "text/plain", "batch_001_Content-Type": "text/plain"},
                  PairList(pair_list=[("batch_000_data", b"one"), ("batch_001_data", b"two")]))
    items = batch.get_batches()
    assert [i.get_as_string() for i in items] == ["one", "two"] and items[1].get_property("content-type") == "text/plain"


def test_output_keeps_code_properties_content_and_item_errors():
    out = Output().add_property("X-A", 1).add_as_json({"k": [1.5]}).add("text", key="other")
    assert (out.code, out.message, out.properties) == (200, "OK", {"X-A": "1"})
    assert out.content.get("data") is None and out.content.value_at(0) == b'{"k":[1.5]}'
    assert out.content.get("other") == b"text"
    err = Output().error("boom")
    assert err.code == 424 and json.loads(err.content.value_at(0)) == {"code": 424, "message": "prediction failure",
                                                                      "error": "boom"}
    item = Output().error("bad", code=400, batch_index=1)
    assert item.code == 200 and item.properties["batch_1_code"] == "400" and item.content.key_at(0) == "batch_1.data"


# -- entry points ------------------------------------------------------------------------------------------------

def resolved(props: dict, env: dict | None = None) -> cfgmod.ResolvedConfig:
    return cfgmod.resolve(props, env or {})


def build(props: dict, local_dir: str, env: dict | None = None):
    return cfgmod.build(resolved(props, env), local_dir=local_dir, spec=cfgmod.read_spec(local_dir, None), num_gpus=0,
                        num_cpus=2, port=8080)


def test_entry_points_choose_the_handler_or_our_engines(tiny_model, tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    (tmp_path / "other.py").write_text("def handle(inputs):\n    return None\n")
    found = build({"option.custom": "x"}, str(tmp_path))
    assert found.scheduler.engine_kind == ENGINE_HANDLER and found.model.entry_point == str(tmp_path / "model.py")
    assert found.model.handler_properties == {"custom": "x", "model_dir": str(tmp_path)}
    named = build({}, str(tmp_path), {"OPTION_ENTRYPOINT": "other.py"})
    assert named.model.entry_point == str(tmp_path / "other.py")
    assert build({}, str(tmp_path), {"DJL_ENTRY_POINT": "other.py"}).model.entry_point == str(tmp_path / "other.py")
    assert build({"option.entryPoint": "my_handlers.main"}, str(tmp_path)).model.entry_point == "my_handlers.main"
    ours = build({"option.entryPoint": "djl_python.huggingface"}, str(tiny_model))
    assert ours.model.entry_point is None
    vllm = build({"option.entryPoint": "djl_python.lmi_vllm"}, str(tiny_model))
    assert vllm.scheduler.engine_kind == ENGINE_PAGED
    with pytest.raises(ConfigError, match="djl_python.transformers_neuronx: it runs on AWS Inferentia"):
        build({"option.entryPoint": "djl_python.transformers_neuronx"}, str(tiny_model))
    with pytest.raises(ConfigError, match="no such file"):
        build({"option.entryPoint": "missing.py"}, str(tmp_path))
    with pytest.raises(ConfigError, match="a handler runs as one process"):
        build({"option.tensor_parallel_degree": "2"}, str(tmp_path))
