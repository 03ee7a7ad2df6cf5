"""Several model copies per host (maxWorkers): placement, balancing, per-copy metrics, and a copy killed
mid-load that loses only its own requests (each answered with an error) and comes back."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from container import config as cfgmod
from container.keys import ConfigError

PROPERTIES = ("engine=Python\noption.dtype=fp32\noption.kv_cache_memory=8MiB\nmaxWorkers=2\nhttp_workers=1\n"
              "option.max_model_len=2048\n")


def build(props: dict, num_gpus: int = 0, num_cpus: int = 2, env: dict | None = None, tiny=None):
    return cfgmod.build(cfgmod.resolve(props, env or {}), local_dir=str(tiny), spec=cfgmod.read_spec(str(tiny), None),
                        num_gpus=num_gpus, num_cpus=num_cpus, port=8080)


def test_copies_are_placed_on_their_own_devices_or_cores(tiny_model, monkeypatch):
    assert build({}, tiny=tiny_model).parallel.copies == 1
    two = build({"maxWorkers": "2"}, tiny=tiny_model).parallel
    assert two.copies == 2 and len(two.copy_cores) == 2 and not set(two.copy_cores[0]) & set(two.copy_cores[1])
    assert build({}, env={"SERVING_MAX_WORKERS": "2"}, tiny=tiny_model).parallel.copies == 2
    assert build({"gpu.minWorkers": "2"}, tiny=tiny_model).parallel.copies == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    gpus = build({"engine": "MPI", "option.tensor_parallel_degree": "2"}, num_gpus=4, tiny=tiny_model).parallel
    assert (gpus.copies, gpus.copy_devices) == (2, [["4", "5"], ["6", "7"]])  # DJL's default under MPI
    with pytest.raises(cfgmod.CapacityError, match="hold at most 2 copies"):
        build({"maxWorkers": "3"}, tiny=tiny_model)
    with pytest.raises(ConfigError, match="minWorkers=2 exceeds maxWorkers=1"):
        build({"minWorkers": "2", "maxWorkers": "1"}, tiny=tiny_model)


def metric(text: str, name: str, copy: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and f'copy="{copy}"' in line:
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for copy {copy}:\n{text}")


def engine_pids(copy_dir_name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="ignore")
            except OSError:
                continue
            if "engines.process.serve" in cmd and re.search(rf"{copy_dir_name}\x00?$", cmd.rstrip("\x00")):
                pids.append(int(entry))
    return pids


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_killed_copy_loses_only_its_requests_and_comes_back(tiny_model, start_server):
    server = start_server(PROPERTIES, tiny_model)
    url = server.url
    metrics = lambda: requests.get(url + "/metrics", timeout=10).text  # noqa: E731
    # /ping is healthy once one copy is ready; the balancing below wants both
    wait_for(lambda: all(metric(metrics(), "lmi_engine_ready", c) == 1.0 for c in "01"), 60, "both copies ready")
    body = {"inputs": "The river ran", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(requests.post, url + "/invocations", json=body, timeout=120) for _ in range(4)]
        wait_for(lambda: all(metric(metrics(), "lmi_requests_running", c) == 2 for c in "01"), 60,
                 "two requests running on each copy")
        pids = engine_pids("copy-1")
        assert pids, "copy 1's engine process not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        statuses = []
        while not all(f.done() for f in futures):  # /ping stays healthy: copy 0 serves
            statuses.append(requests.get(url + "/ping", timeout=10).status_code)
            time.sleep(0.05)
        results = [f.result() for f in futures]
    assert set(statuses) == {200}
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 424, 424], [r.text for r in results]
    for r in results:
        if r.status_code == 200:
            assert r.json()["generated_text"]
        else:
            assert "model copy 1" in r.json()["error"]
    wait_for(lambda: metric(metrics(), "lmi_engine_ready", "1") == 1.0, 90, "copy 1 back")
    steps = metric(metrics(), "lmi_engine_steps_total", "1")
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: requests.post(url + "/invocations", json={
            "inputs": "Again", "parameters": {"max_new_tokens": 30}}, timeout=60), range(2)))
    assert [r.status_code for r in replies] == [200, 200]
    assert metric(metrics(), "lmi_engine_steps_total", "1") > steps  # the restarted copy serves
    assert "model copy 1 died" in server.log()
    wait_for(lambda: "model copy 1 is back" in server.log(), 10, "the launcher's note that copy 1 is back")
    assert server.stop() == 0, server.log()  # both copies drained and stopped
