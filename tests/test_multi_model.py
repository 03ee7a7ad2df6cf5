"""Several models behind one server (docs/multi-model.md): a real server in SageMaker's multi-model
mode, three tiny models of different families registered at run time through DJL's management API
and SageMaker's contract (a local dir running the paged engine, a Qwen2 from S3 on a real
S3-compatible server running the padded rolling engine, and a model.py handler calling transformers),
checked against HF `generate` on every route that names a model, concurrently; a memory budget that
holds two of them (the least recently used unloads, in-flight requests first finishing); a killed
engine; DELETE during a stream; the allow-list and the custom-code rule."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading

import pytest
import requests

from container import registration
from container.registration import Refusal
from tests.support import Server, hf_oracle, wait_for
from tests.test_custom_handlers import CALLS_TRANSFORMERS

MIB = 1 << 20
NEED_MB = 1000  # each model's required_memory_mb; the budget holds two
PROMPT = "The river ran"
TARGET = "X-Amzn-SageMaker-Target-Model"


@pytest.fixture(scope="module")
def three(tiny_model, tmp_path_factory, moto_endpoint):
    """(llama dir, qwen2 s3:// url and local dir, handler dir), the S3 copy uploaded to moto."""
    import boto3

    from container.model_maker import make_model

    root = tmp_path_factory.mktemp("mme")
    qwen = root / "qwen"
    make_model(str(qwen), arch="qwen2", size="tiny", seed=3)
    (qwen / "serving.properties").write_text("option.rolling_batch=scheduler\noption.dtype=fp32\n")
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="lmi-mme")
    for path in qwen.iterdir():
        s3.upload_file(str(path), "lmi-mme", f"qwen/{path.name}")
    handler = root / "handler"
    make_model(str(handler), arch="mistral", size="tiny", seed=5)
    (handler / "model.py").write_text(CALLS_TRANSFORMERS)
    return tiny_model, "s3://lmi-mme/qwen/", qwen, handler


@pytest.fixture(scope="module")
def server(three, tmp_path_factory, moto_endpoint):
    llama, _, _, _ = three
    tmp = tmp_path_factory.mktemp("mme-server")
    env = {"SAGEMAKER_MULTI_MODEL": "true", "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    props = (f"model_url_pattern=^({llama.parent}/|{tmp_path_factory.getbasetemp()}/|s3://lmi-mme/)\n"
             f"allow_custom_code=true\noption.max_models_memory={2 * NEED_MB * MIB + MIB}\n"
             f"download_dir={tmp / 'downloads'}\n")
    srv = Server(tmp, props, None, env=env)
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oracles(three):
    llama, _, qwen, handler = three
    return {"llama": hf_oracle(llama), "qwen": hf_oracle(qwen), "handler": hf_oracle(handler)}


def _register_all(server, three) -> None:
    llama, s3_url, _, handler = three
    resp = requests.post(server.url + "/models", params={"url": str(llama), "model_name": "llama", "option.dtype": "fp32",
                                                          "required_memory_mb": NEED_MB}, timeout=120)
    assert (resp.status_code, resp.json()) == (200, {"status": "Model \"llama\" registered."}), server.log()
    resp = requests.post(server.url + "/models", json={"model_name": "qwen", "url": s3_url,
                                                        "required_memory_mb": NEED_MB}, timeout=120)
    assert resp.status_code == 200, resp.text
    resp = requests.post(server.url + "/models", json={"model_name": "llama", "url": str(llama)}, timeout=30)
    assert (resp.status_code, resp.json()["error"]) == (409, "Model llama is already registered.")
    resp = requests.post(server.url + "/models", params={"url": str(handler), "model_name": "handler",
                                                          "required_memory_mb": NEED_MB}, timeout=120)
    assert resp.status_code == 200, resp.text


def _text(server, name: str, how: str, hf, n: int = 12) -> str:
    """Greedy text of `name` through one of the routes that name a model."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": n}}
    if name == "handler":  # a handler serves /invocations only: its own JSON answer
        path = {"predictions": "/predictions/handler", "invoke": "/models/handler/invoke"}.get(how, "/invocations")
        resp = requests.post(server.url + path, json=body, headers={TARGET: "handler.tar.gz"}, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["generated_text"]
    if how == "openai":
        resp = requests.post(server.url + "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": n,
                                                                   "temperature": 0}, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    path, headers = {"predictions": (f"/predictions/{name}", {}), "invoke": (f"/models/{name}/invoke", {TARGET: name}),
                     "target": ("/invocations", {TARGET: f"{name}.tar.gz"})}[how]
    resp = requests.post(server.url + path, json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["generated_text"]


def _expected(hf, n: int = 12) -> str:
    return hf.decode(hf(PROMPT, n))


def test_three_models_registered_at_run_time_answer_like_hf_on_every_route(server, three, oracles):
    _register_all(server, three)
    listing = requests.get(server.url + "/models", timeout=10).json()
    assert {m["modelName"] for m in listing["models"]} == {"llama", "qwen", "handler"}
    assert "nextPageToken" not in listing
    page = requests.get(server.url + "/models", params={"limit": 2}, timeout=10).json()
    assert len(page["models"]) == 2 and page["nextPageToken"] == "2"
    # the budget holds two: registering the third unloaded the least recently used (llama)
    assert {m["modelName"]: m["status"] for m in listing["models"]}["llama"] == "UNLOADED"
    # concurrently, grouped by model (the cycling test below is the one that makes them take turns)
    cases = [(name, how) for name in ("handler", "qwen", "llama")
             for how in ("predictions", "invoke", "target", "openai")[:3 if name == "handler" else 4]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda c: _text(server, c[0], c[1], oracles[c[0]]), cases))
    for (name, how), text in zip(cases, texts):
        assert text == _expected(oracles[name]), (name, how)
    # an unknown model: 404 naming the served ones, on every route family
    resp = requests.post(server.url + "/predictions/nope", json={"inputs": PROMPT}, timeout=10)
    assert resp.status_code == 404 and "Model or workflow not found: nope" in resp.json()["error"]
    resp = requests.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = requests.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)  # no model named
    assert resp.status_code == 400 and "this server serves several models" in resp.json()["error"]["message"]
    resp = requests.post(server.url + "/invocations", json={"inputs": PROMPT}, timeout=10)
    assert resp.status_code == 400 and "Parameter model_name is required" in resp.json()["error"]
    ping = requests.get(server.url + "/ping", timeout=5)
    assert ping.status_code == 200 and set(ping.json()["models"]) == {"llama", "qwen", "handler"}
    # each HTTP worker publishes its counts within request_metrics.FLUSH_S: the other worker's last ones may lag
    tokens = 4 * len(oracles["llama"](PROMPT, 12))  # predictions, invoke, target, openai
    counted = f'vllm:generation_tokens_total{{model="llama"}} {float(tokens)}'
    metrics = wait_for(lambda: next((t for t in [requests.get(server.url + "/metrics", timeout=10).text] if counted in t),
                                    None), 10, "every worker's request metrics")
    assert 'lmi_model_evictions_total{model="llama"}' in metrics
    assert 'lmi_http_requests_total{model="qwen",route="/predictions/<model_name>",status="200"} 1.0' in metrics
    assert 'vllm:request_success_total{finished_reason="length",model="handler"}' not in metrics  # (its own code)
    loaded = [m for m in requests.get(server.url + "/models", timeout=5).json()["models"] if m["status"] == "READY"]
    kinds = {"llama": "paged", "qwen": "rolling", "handler": "handler"}
    for m in loaded:  # every engine sample labelled with its model
        assert f'lmi_engine_ready{{engine="{kinds[m["modelName"]]}",model="{m["modelName"]}",state="ready"}} 1.0' \
            in metrics
    described = requests.get(server.url + "/models/qwen", timeout=10).json()
    assert described["engine"] == "rolling" and described["modelUrl"] == three[1] and described["workers"] == 1


def test_lmi_config_lists_a_running_servers_models_and_where_each_runs(server, three, capsys):
    from container.cli import main

    _ensure_registered(server, three)
    assert main(["config", "--server", server.url]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert [line.split(":")[0] for line in lines] == ["handler", "llama", "qwen"]
    ready = [line for line in lines if ": READY, " in line]
    assert len(ready) == 2 and all(" copy(ies) on cpu cores " in line for line in ready), lines
    assert any(line.startswith("qwen: ") and line.endswith(f"from {three[1]}") for line in lines)


def test_requests_cycling_over_three_models_in_a_budget_of_two(server, three, oracles):
    _ensure_registered(server, three)
    before = _counts(server)
    order = ["llama", "qwen", "handler", "llama", "qwen", "handler"]  # any two resident: each request moves one
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda name: _text(server, name, "predictions", oracles[name]), order))
    for name, text in zip(order, texts):
        assert text == _expected(oracles[name]), name
    after = _counts(server)
    assert sum(after["loads"].values()) > sum(before["loads"].values())
    assert sum(after["evictions"].values()) > sum(before["evictions"].values())
    assert "(least recently used) to make room" in server.log()
    # one that can never fit: 507, nothing registered, the others untouched
    resp = requests.post(server.url + "/models", params={"url": str(three[0]), "model_name": "huge",
                                                          "required_memory_mb": 3 * NEED_MB}, timeout=60)
    assert resp.status_code == 507 and "more than the whole memory budget" in resp.json()["error"]
    assert "huge" not in {m["modelName"] for m in requests.get(server.url + "/models", timeout=5).json()["models"]}


def test_a_killed_engine_fails_its_requests_and_restarts_alone(server, three, oracles):
    _ensure_registered(server, three)
    assert _text(server, "qwen", "predictions", oracles["qwen"]) == _expected(oracles["qwen"])
    assert _text(server, "llama", "predictions", oracles["llama"]) == _expected(oracles["llama"])
    in_flight: dict = {}
    thread = threading.Thread(target=lambda: in_flight.update(r=requests.post(
        server.url + "/predictions/qwen", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 400,
                                                                                 "ignore_eos": True}}, timeout=120)))
    thread.start()
    wait_for(lambda: 'lmi_requests_running{model="qwen"} 1.0' in requests.get(server.url + "/metrics",
                                                                              timeout=10).text, 30, "qwen running")
    os.kill(_engine_pid("qwen"), signal.SIGKILL)
    thread.join(timeout=60)
    assert in_flight["r"].status_code == 424, in_flight["r"].text
    assert "the model failed during generation" in in_flight["r"].json()["error"]
    assert _text(server, "llama", "predictions", oracles["llama"]) == _expected(oracles["llama"])
    wait_for(lambda: requests.post(server.url + "/predictions/qwen", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12}}, timeout=60).status_code == 200, 90, "qwen serving again")
    assert _text(server, "qwen", "predictions", oracles["qwen"]) == _expected(oracles["qwen"])
    assert "model copy 0 died" in server.log()


def test_delete_during_a_stream_lets_it_finish_and_then_404s(server, three, oracles):
    _ensure_registered(server, three)
    hf = oracles["llama"]
    resp = requests.post(server.url + "/predictions/llama", json={"inputs": PROMPT, "stream": True, "parameters": {
        "max_new_tokens": 60, "ignore_eos": True}}, stream=True, timeout=120)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    first = json.loads(next(lines))
    deleted: dict = {}
    thread = threading.Thread(target=lambda: deleted.update(r=requests.delete(server.url + "/models/llama",
                                                                              timeout=300)))
    thread.start()
    wait_for(lambda: requests.get(server.url + "/models/llama", timeout=5).status_code == 404, 10, "llama leaving")
    refused = requests.post(server.url + "/predictions/llama", json={"inputs": PROMPT}, timeout=10)
    assert refused.status_code == 404 and "Model or workflow not found: llama" in refused.json()["error"]
    rest = [json.loads(line) for line in lines if line]
    ids = [first["token"]["id"]] + [r["token"]["id"] for r in rest]
    assert ids == hf(PROMPT, 60) and rest[-1]["generated_text"]
    thread.join(timeout=60)
    assert deleted["r"].status_code == 200
    assert deleted["r"].json() == {"status": "Model or workflow \"llama\" unregistered"}
    assert _text(server, "qwen", "predictions", oracles["qwen"]) == _expected(oracles["qwen"])


def test_registrations_outside_the_rules_are_refused(server, three, tmp_path):
    resp = requests.post(server.url + "/models", params={"url": "s3://another-bucket/model/", "model_name": "x"},
                         timeout=30)
    assert resp.status_code == 403 and "model_url_pattern" in resp.json()["error"]
    resp = requests.post(server.url + "/models", json={"model_name": "x", "url": "Qwen/Qwen2.5-0.5B"}, timeout=30)
    assert resp.status_code == 403
    # a model.py where custom code is not allowed: refused at registration, naming the rule
    with pytest.raises(Refusal) as refused:
        registration.register("h", str(three[3]), {}, url_pattern=".*", allow_custom_code=False, download_dir="",
                              num_gpus=0, num_cpus=2, port=8080, device_bytes=0)
    assert refused.value.code == 403 and "allow_custom_code" in refused.value.message
    assert "model.py" in refused.value.message
    with pytest.raises(Refusal) as refused:
        registration.register("r", str(three[0]), {"option.trust_remote_code": "true"}, url_pattern=".*",
                              allow_custom_code=False, download_dir="", num_gpus=0, num_cpus=2, port=8080,
                              device_bytes=0)
    assert refused.value.code == 403 and "trust_remote_code" in refused.value.message


def _ensure_registered(server, three) -> None:
    names = {m["modelName"] for m in requests.get(server.url + "/models", timeout=5).json()["models"]}
    llama, s3_url, _, handler = three
    for name, url in (("llama", str(llama)), ("qwen", s3_url), ("handler", str(handler))):
        if name not in names:
            # fp32 (DJL's option.* in the body): greedy ids equal HF's on any host, bf16 where it is fast included
            resp = requests.post(server.url + "/models", json={"model_name": name, "url": url, "option.dtype": "fp32",
                                                                "required_memory_mb": NEED_MB}, timeout=120)
            assert resp.status_code == 200, resp.text


def _counts(server) -> dict:
    out: dict = {"loads": {}, "evictions": {}}
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        for what in out:
            if line.startswith(f"lmi_model_{what}_total{{"):
                out[what][line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def _engine_pid(name: str) -> int:
    """The engine process serving `name` (its run directory ends in -<name>)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"engines.process.serve" in args and any(a.endswith(f"-{name}".encode()) for a in args):
            return int(pid)
    raise AssertionError(f"no engine process for {name}")


def test_placement_packs_small_models_and_gives_a_large_one_a_tp_group_of_its_own():
    from container.registry import place_on_cores, place_on_devices

    gib = 1 << 30
    held = {str(d): 0 for d in range(4)}  # four 80 GiB GPUs
    for _ in range(6):  # six small models of 10 GiB: the emptiest GPU each time
        [[device]] = place_on_devices(held, 80 * gib, 10 * gib, 1, 1)
        held[device] += 10 * gib
    assert sorted(held.values()) == [10 * gib, 10 * gib, 20 * gib, 20 * gib]
    # a TP-2 model of 70 GiB per rank: the two GPUs with room for it, none with three models
    assert place_on_devices(held, 80 * gib, 70 * gib, 2, 1) == [sorted(d for d in held if held[d] == 10 * gib)]
    assert place_on_devices(held, 80 * gib, 71 * gib, 2, 1) is None  # no room left anywhere: the caller's 507
    assert place_on_devices({"0": 0, "1": 0}, 80 * gib, 30 * gib, 1, 2) == [["0"], ["1"]]  # copies spread
    # CPU: a model's copies on disjoint shares of the least used cores
    assert place_on_cores({0: 0, 1: 0, 2: 0, 3: 0}, 2, 2) == [[0, 1], [2, 3]]
    assert place_on_cores({0: 2, 1: 1, 2: 1, 3: 2}, 2, 1) == [[1, 2]]
