"""Launcher supervision, the SageMaker entrypoint, and a model served from a loopback S3 server."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import boto3
import requests

from tests.support import LMI, ROOT, free_port, wait_for

SLOW_BATCH = """
engine=Python
option.rolling_batch=disable
batch_size=4
max_batch_delay=3000
option.dtype=fp32
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def _engine_pid(launcher_pid: int) -> int:
    (pid,) = [p for p in _children(launcher_pid) if "engines.process.serve" in _cmdline(p)]
    return pid


def test_sagemaker_entrypoint_drains_in_flight_requests_on_sigterm(tiny_model, tmp_path, start_server):
    model_dir = tmp_path / "opt-ml-model"
    shutil.copytree(tiny_model, model_dir)
    (model_dir / "serving.properties").write_text(SLOW_BATCH)
    port = free_port()
    env = {"SAGEMAKER_MODEL_DIR": str(model_dir), "SAGEMAKER_BIND_TO_PORT": str(port),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    server = start_server(None, None, cmd=[str(ROOT / "container" / "serve"), "serve"], env=env, wait=False)
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    server.wait_ready()
    engine = _engine_pid(server.proc.pid)  # the script execs `lmi serve`: same pid
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # waits ~3 s in the batcher (max_batch_delay) and is still in flight when SIGTERM arrives
        pending = pool.submit(server.post, {"inputs": "The river", "parameters": {"max_new_tokens": 5}})
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        resp = pending.result(timeout=60)
    assert resp.status_code == 200 and resp.json()[0]["generated_text"] is not None
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert not _alive([engine])
    try:
        requests.get(server.url + "/ping", timeout=2)
        raise AssertionError("still listening after shutdown")
    except requests.ConnectionError:
        pass


def test_server_exits_non_zero_when_the_engine_dies(tiny_model, start_server):
    server = start_server(SLOW_BATCH, tiny_model)
    engine = _engine_pid(server.proc.pid)
    group = _descendants(server.proc.pid)
    assert len(group) >= 4  # engine, gunicorn master, 2 workers
    os.kill(engine, signal.SIGKILL)
    started = time.monotonic()
    code = server.proc.wait(timeout=30)
    assert code != 0
    assert time.monotonic() - started < 10
    assert "the engine exited" in server.log()
    assert _alive(group) == []


def _last_line(server) -> str:
    return [line for line in server.log().splitlines() if line.strip()][-1]


def _startup_failure(server) -> str:
    """The server exits non-zero and its last log line names the cause."""
    assert server.proc.wait(timeout=60) != 0, server.log()
    last = _last_line(server)
    assert "lmi-serve did not start: " in last, server.log()
    return last.split("lmi-serve did not start: ", 1)[1]


def _model_copy(tiny_model: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    dest.mkdir()
    for path in tiny_model.iterdir():
        if path.name not in skip:
            shutil.copy(path, dest / path.name)
    return dest


def test_no_model_files_is_named_as_the_cause(tmp_path, start_server):
    (tmp_path / "empty").mkdir()
    cause = _startup_failure(start_server(SLOW_BATCH, tmp_path / "empty", wait=False))
    assert cause.startswith("no model files in") and "config.json" in cause


def test_missing_weights_are_named_as_the_cause(tiny_model, tmp_path, start_server):
    broken = _model_copy(tiny_model, tmp_path / "broken", skip=("model.safetensors",))
    cause = _startup_failure(start_server(SLOW_BATCH, broken, wait=False))
    assert cause.startswith("no model weights in")


def test_a_missing_tokenizer_is_named_as_the_cause(tiny_model, tmp_path, start_server):
    broken = _model_copy(tiny_model, tmp_path / "broken", skip=("tokenizer.json",))
    assert _startup_failure(start_server(SLOW_BATCH, broken, wait=False)).startswith("no tokenizer.json in")


def test_unreadable_weights_are_named_as_the_cause(tiny_model, tmp_path, start_server):
    broken = _model_copy(tiny_model, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    cause = _startup_failure(start_server(SLOW_BATCH, broken, wait=False))
    assert "model.safetensors is not a safetensors file" in cause


def test_a_port_in_use_is_named_as_the_cause(tiny_model, tmp_path, start_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server(SLOW_BATCH, tiny_model, wait=False,
                              cmd=[*LMI, "serve", "--host", "127.0.0.1", "--port", str(port),
                                   "--model-dir", str(tiny_model)])
        cause = _startup_failure(server)
    assert cause.startswith(f"port {port} on 127.0.0.1 is already in use")
    assert "engine ready" not in server.log()


def test_mpirun_not_found_is_named_as_the_cause(tiny_model, start_server):
    props = "engine=MPI\noption.tensor_parallel_degree=2\noption.rolling_batch=scheduler\n"
    server = start_server(props, tiny_model, wait=False, env={"PATH": os.path.dirname(sys.executable)})
    assert _startup_failure(server).startswith("mpirun was not found on PATH")


def test_an_engine_that_fails_to_load_names_the_cause(tiny_model, tmp_path, start_server):
    broken = _model_copy(tiny_model, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the checkpoint lacks the last layer's weights
    (broken / "config.json").write_text(json.dumps(config))
    cause = _startup_failure(start_server("option.rolling_batch=scheduler\noption.dtype=fp32\n", broken, wait=False))
    assert cause.startswith("the engine failed to load the model: ")


def test_make_model_files_are_readable_by_other_users(tiny_model):
    for path in [tiny_model, *tiny_model.iterdir()]:
        assert os.stat(path).st_mode & 0o004, f"{path} is not world-readable"


DRAIN = """
engine=Python
option.rolling_batch=scheduler
option.dtype=fp32
option.kv_cache_memory=64MiB
drain_timeout=1
"""


def test_sigterm_drains_within_the_budget_refuses_new_work_and_aborts_the_rest(tmp_path, start_server):
    from container.model_maker import make_model

    # wider and deeper than the tiny model: 1000 tokens take several seconds, far past the 1 s drain
    model_dir = tmp_path / "slower"
    make_model(str(model_dir), size="tiny", seed=5, overrides=dict(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024))
    server = start_server(DRAIN, model_dir)
    long_params = {"max_new_tokens": 1000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long_plain = pool.submit(server.post, {"inputs": "The", "parameters": long_params})
        stream = requests.post(server.url + "/invocations", json={"inputs": "The", "stream": True,
                                                                  "parameters": long_params}, stream=True, timeout=60)
        lines = stream.iter_lines()
        next(lines)
        wait_for(lambda: requests.get(server.url + "/ping", timeout=5).json()["running"] == 2, 10, "2 running")
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        short = pool.submit(server.post, {"inputs": "The river", "parameters": {"max_new_tokens": 3}})
        # once the drain has begun: new work and /ping get 503
        refused = wait_for(lambda: [r for r in [server.post({"inputs": "x"})] if r.status_code == 503], 5, "a 503")[0]
        assert "shutting down" in refused.json()["error"] and refused.headers["Retry-After"] == "1"
        assert requests.get(server.url + "/ping", timeout=5).status_code == 503
        rest = [json.loads(line) for line in lines if line]
        plain = long_plain.result(timeout=30)
        assert short.result(timeout=30).status_code in (200, 503)  # before or after the drain began
    assert plain.status_code == 503 and "drain" in plain.json()["error"]
    assert rest[-1]["code"] == 503 and "drain" in rest[-1]["error"]  # the stream had its 200: an error line
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert time.monotonic() - signalled < 1 + 8, server.log()


def _upload(endpoint: str, model_dir: Path, bucket: str, prefix: str) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=bucket)
    for path in model_dir.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(model_dir)}")


def test_s3_model_loads_end_to_end_and_a_restart_reuses_the_cache(tiny_model, moto_endpoint, tmp_path,
                                                                   start_server):
    _upload(moto_endpoint, tiny_model, "lmi-models", "tiny/v1")
    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    props = SLOW_BATCH.replace("max_batch_delay=3000", "max_batch_delay=10") + \
        f"option.model_id=s3://lmi-models/tiny/v1/\ndownload_dir={tmp_path / 'cache'}\n"
    first = start_server(props, None, env=env)
    answer = first.post({"inputs": "The river", "parameters": {"max_new_tokens": 6}}).json()
    assert first.stop() == 0
    assert "downloaded" in first.log() and "s3://lmi-models/tiny/v1/" in first.log()
    # the second start must not need S3 at all: point boto3 at a closed port
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    second = start_server(props, None, env=env)
    assert second.post({"inputs": "The river", "parameters": {"max_new_tokens": 6}}).json() == answer
    assert "reusing cached download" in second.log()
