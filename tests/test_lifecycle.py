"""Launcher supervision, the SageMaker entrypoint, and a model served from a loopback S3 server."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import boto3
import requests

from tests.support import ROOT, free_port

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
    (pid,) = [p for p in _children(launcher_pid) if "engines.serve" in _cmdline(p)]
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


def test_engine_that_fails_to_load_stops_the_server(tiny_model, tmp_path, start_server):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # everything but the weights
        shutil.copy(tiny_model / name, broken / name)
    server = start_server(SLOW_BATCH, broken, wait=False)
    assert server.proc.wait(timeout=60) != 0
    assert "engine failed to load" in server.log()


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
