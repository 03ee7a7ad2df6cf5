"""Several model copies per host (maxWorkers): placement, balancing, per-copy metrics, and a copy killed
mid-load that loses only its own requests that had output (each answered with an error) and comes back;
those that had none are re-sent to a copy that serves."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from container import config as cfgmod
from container.keys import ConfigError
from engines.process.rundir import copy_dirs, failure_path, ready_path, write_failure
from engines.protocol import Add, Output
from engines.sampling_params import SamplingParams
from handlers.engine_pool import EnginePool
from handlers.errors import HttpError
from handlers.generation import CopyDied, Generation
from handlers.schemas import GenerationRequest
from handlers.tokenizer import TextTokenizer

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


def engine_pids(copy_dir_name: str, launcher: int) -> list[int]:
    """The engine processes of one copy of the server whose launcher is `launcher` (others' servers may
    run beside ours, with their own copy-1)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="ignore")
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == launcher and "engines.process.serve" in cmd and \
                    re.search(rf"{copy_dir_name}\x00?$", cmd.rstrip("\x00")):
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


def make_copies(run_dir) -> list[str]:
    """Two copies' directories, each with its engine's ready file (no engine behind: placement only)."""
    dirs = copy_dirs(str(run_dir), 2)
    for d in dirs:
        os.makedirs(d)
        open(ready_path(d), "w").close()
    return dirs


def test_the_pool_resends_a_request_to_a_live_copy_and_counts_it_there(tmp_path):
    dirs = make_copies(tmp_path)
    pool = EnginePool(str(tmp_path), 2)
    pool.add(Add("r1", [1, 2, 3], SamplingParams(max_new_tokens=5)))
    first = pool.copy_of("r1")
    other = 1 - first
    assert pool._load[first] == 8 and pool._load[other] == 0 and pool.copy_died("r1") is None
    write_failure(dirs[first], "engine", "the engine exited with code -9")
    assert pool.copy_died("r1") == (first, "the engine exited with code -9")
    assert pool.resend("r1") is not None
    assert (pool.copy_of("r1"), pool._load[first], pool._load[other]) == (other, 0, 8)
    # the stream on the dead copy is released; the request lives on the other one
    assert (pool.clients[first].num_in_flight, pool.clients[other].num_in_flight) == (0, 1)
    assert pool.copy_died("r1") is None
    pool.add(Add("r2", [1], SamplingParams(max_new_tokens=1)))
    assert pool.copy_of("r2") == other  # new requests avoid the dead copy
    write_failure(dirs[other], "engine", "the engine exited with code -9")
    assert pool.resend("r1") is None and pool.copy_of("r1") == other  # no copy serves: nothing moves
    pool.abort("r1")
    pool.release("r2")
    assert pool._load == [0, 0] and pool.clients[other].num_in_flight == 0


def test_a_request_learns_its_copy_died_even_once_the_copy_is_back(tmp_path):
    """The launcher restarts a dead copy 1.5 s after its death (its failure file goes): a request not
    watched meanwhile (the second input of a reply) still learns that its copy died."""
    dirs = make_copies(tmp_path)
    pool = EnginePool(str(tmp_path), 2)
    write_failure(dirs[0], "engine", "the engine exited with code 1")  # every request goes to copy 1
    pool.add(Add("sent", [1], SamplingParams(max_new_tokens=1)))
    os.remove(ready_path(dirs[1]))  # copy 1 restarts: its last life's ready file goes
    assert pool.copy_died("sent") == (1, "the engine died and was restarted")
    pool.add(Add("waits", [1], SamplingParams(max_new_tokens=1)))  # for copy 1's next engine: not lost by its start
    open(ready_path(dirs[1]), "w").close()
    assert pool.copy_of("waits") == 1 and pool.copy_died("waits") is None
    os.remove(failure_path(dirs[0], "engine"))


class FakePool:
    """A pool whose n-th send of a request delivers the n-th list of outputs (a copy that died: none)."""

    def __init__(self, outputs: list[list[Output]], serving: bool = True):
        self.outputs = outputs
        self.serving = serving
        self.sends = 0
        self.aborted: list[str] = []

    def add(self, request) -> queue.SimpleQueue:
        q = queue.SimpleQueue()
        for out in self.outputs[self.sends]:
            q.put(out)
        self.sends += 1
        return q

    def resend(self, request_id: str) -> queue.SimpleQueue | None:
        return self.add(None) if self.serving else None

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release(self, request_id: str) -> None:
        pass


def follow(pool: FakePool, tiny_model, deaths: list) -> Generation:
    """A Generation of two tokens whose checks find the copy deaths listed in `deaths`, one each."""
    req = GenerationRequest(["x"], False, SamplingParams(max_new_tokens=2))
    return Generation(pool, "r", [1, 2], "x", req, TextTokenizer(str(tiny_model)),
                      lambda: deaths.pop() if deaths else None)


def test_a_generation_moves_to_another_copy_only_before_its_first_token(tiny_model):
    done = [Output("r", [5]), Output("r", [6], finished=True, finish_reason="length")]
    pool = FakePool([[], done])
    gen = follow(pool, tiny_model, [CopyDied(1, "the engine exited")])
    assert [t["id"] for t in gen.tokens(time.monotonic() + 10)] == [5, 6]
    assert (pool.sends, gen.finish_reason, pool.aborted) == (2, "length", [])

    pool = FakePool([[Output("r", [5])], done])
    deaths: list = []
    tokens = follow(pool, tiny_model, deaths).tokens(time.monotonic() + 10)
    assert next(tokens)["id"] == 5
    deaths.append(CopyDied(1, "the engine exited"))
    with pytest.raises(HttpError, match=r"^the model failed during generation: model copy 1: the engine exited "
                                        r"\(after 1 generated token\)$"):
        next(tokens)
    assert (pool.sends, pool.aborted) == (1, ["r"])

    pool = FakePool([[], done], serving=False)  # no other copy serves: it fails as it did
    with pytest.raises(CopyDied, match="model copy 1: the engine exited$"):
        list(follow(pool, tiny_model, [CopyDied(1, "the engine exited")]).tokens(time.monotonic() + 10))
    assert pool.sends == 1

PROMPTS = ("The river ran", "Once upon a time", "A small cat sat", "In the morning", "The old house", "She said")


def ask(url: str, prompt: str, stream: bool) -> dict:
    """One short request: its status, text, error and, for a stream, how many tokens arrived before it ended."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 6}, "stream": stream}
    r = requests.post(url + "/invocations", json=body, timeout=60, stream=stream)
    if not stream or r.status_code != 200:
        reply = r.json()
        return {"status": r.status_code, "text": reply.get("generated_text"), "error": reply.get("error")}
    lines = [json.loads(line) for line in r.iter_lines() if line]
    return {"status": 200, "text": lines[-1].get("generated_text"), "error": lines[-1].get("error"),
            "tokens": sum(1 for line in lines if line.get("token"))}


def test_a_killed_copy_fails_only_requests_that_had_output(tiny_model, start_server):
    """Copy 1 killed under steady load (6 clients, 360 short requests, half streamed). One running
    sequence per copy: the balancing keeps two or more requests on each copy, so copy 1 dies with
    at least one that has no output, which must be re-sent and answered."""
    server = start_server(PROPERTIES + "option.max_rolling_batch_size=1\n", tiny_model)
    url = server.url
    wait_for(lambda: all(metric(requests.get(url + "/metrics", timeout=10).text, "lmi_engine_ready", c) == 1.0
                         for c in "01"), 60, "both copies ready")
    expected = {p: ask(url, p, False)["text"] for p in PROMPTS}
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(360):
        jobs.put((PROMPTS[i % len(PROMPTS)], i % 2 == 1))
    results: list[tuple[str, bool, dict]] = []

    def client() -> None:
        while True:
            try:
                prompt, stream = jobs.get_nowait()
            except queue.Empty:
                return
            results.append((prompt, stream, ask(url, prompt, stream)))

    with ThreadPoolExecutor(6) as pool:
        clients = [pool.submit(client) for _ in range(6)]
        wait_for(lambda: len(results) >= 60, 60, "60 requests answered")
        pids = wait_for(lambda: engine_pids("copy-1", server.proc.pid), 10, "copy 1's engine process")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for c in clients:
            c.result()
    assert len(results) == 360
    failed = [(stream, r) for _, stream, r in results if r["error"] is not None]
    for prompt, stream, r in results:
        if r["error"] is None:
            assert (r["status"], r["text"]) == (200, expected[prompt]), (prompt, stream, r)
    # only requests that had output fail: a stream after its first token, a reply after a generated token
    for stream, r in failed:
        assert re.search(r"model copy 1: .* \(after [1-9]\d* generated tokens?\)$", r["error"]), r
        assert (r["status"], r.get("tokens", 1) >= 1) == ((200, True) if stream else (424, True)), r
    assert len(failed) <= 1, failed  # copy 1 had one sequence running
    assert server.log().count("died before the request's first token: re-sent") >= 1
    assert "model copy 1 died" in server.log()



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
        pids = engine_pids("copy-1", server.proc.pid)
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
        else:  # both had output when copy 1 died: they fail, not re-sent
            assert re.search(r"model copy 1: .* \(after [1-9]\d* generated tokens?\)$", r.json()["error"]), r.text
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
