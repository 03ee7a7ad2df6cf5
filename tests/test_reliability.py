"""Defects found under load and fuzzing (issue 8), each pinned by a test: the IPC, request identity,
health under load, input limits, disconnects, refused streams, extreme sampling values, 400s
instead of 500s, leaks, and the engine's own failure paths. Servers are real; where a fake engine
stands in, it is only to push the IPC layer past its limits.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import tempfile
import threading
import time

import pytest
import requests

from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
from engines.process.endpoint import EngineEndpoint
from engines.protocol import STATE_LOADING, Abort, Add, HealthReply, Output
from engines.process.rundir import engine_socket_path
from engines.sampling_params import SamplingParams
from handlers.engine_client import EngineClient
from tests.support import ping, running_server, wait_for, wait_idle, wait_running


def strict_json(text: str):
    """json.loads that refuses NaN and infinities (which are not JSON)."""
    def refuse(name):
        raise ValueError(f"{name} in a JSON body")
    return json.loads(text, parse_constant=refuse)


# -- the IPC: nothing lost, whatever the burst -----------------------------------------------------

class EchoEngine:
    """Answers every ADD with `num_outputs` one-token outputs at once, the last one finished."""

    def __init__(self, num_outputs: int):
        self.num_outputs = num_outputs
        self.publish = None
        self.aborted: list[str] = []

    def on_message(self, msg) -> None:
        if isinstance(msg, Abort):
            self.aborted.append(msg.request_id)
            return
        n = self.num_outputs
        self.publish([Output(msg.request_id, [i], [-1.0], finished=i == n - 1, finish_reason="length" if i == n - 1
                             else None) for i in range(n)])


@pytest.fixture
def ipc_pair():
    """A real endpoint and client over an ipc:// socket, with high-water marks of 8 messages."""
    made = []

    def make(engine):
        run_dir = tempfile.mkdtemp(prefix="lmi-ipc-")
        endpoint = EngineEndpoint(engine_socket_path(run_dir), engine.on_message, lambda: HealthReply("ready"), hwm=8)
        engine.publish = endpoint.publish
        endpoint.start()
        client = EngineClient(engine_socket_path(run_dir), hwm=8)
        made.append(endpoint)
        return endpoint, client

    yield make
    for endpoint in made:
        endpoint.close()


def _collect(q, deadline: float) -> list[Output]:
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(q.get(timeout=max(deadline - time.monotonic(), 0.01)))
    return outs


def test_a_burst_of_adds_and_outputs_far_past_the_high_water_marks_loses_nothing(ipc_pair):
    # 3,000 requests from 16 threads, 5 outputs each: 15,000 outputs through queues of 8
    endpoint, client = ipc_pair(EchoEngine(num_outputs=5))
    ids = [f"r{i}" for i in range(3000)]

    def send(chunk):
        return [(rid, client.add(Add(rid, [1, 2], SamplingParams()))) for rid in chunk]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        queues = [pair for part in pool.map(send, [ids[i::16] for i in range(16)]) for pair in part]
    deadline = time.monotonic() + 60
    for rid, q in queues:
        outs = _collect(q, deadline)
        assert [o.token_ids[0] for o in outs] == [0, 1, 2, 3, 4], rid
    assert client.num_in_flight == 0 and endpoint.num_owners == 0


def test_an_abort_releases_the_endpoints_record_of_the_request(ipc_pair):
    class Silent(EchoEngine):
        def on_message(self, msg):
            if isinstance(msg, Abort):
                self.aborted.append(msg.request_id)

    engine = Silent(1)
    endpoint, client = ipc_pair(engine)
    for i in range(50):
        client.add(Add(f"a{i}", [1], SamplingParams()))
        client.abort(f"a{i}")
    wait_for(lambda: len(engine.aborted) == 50, 10, "the aborts to arrive")
    assert endpoint.num_owners == 0 and client.num_in_flight == 0


def test_the_same_request_id_twice_in_one_client_is_refused():
    client = EngineClient(engine_socket_path(tempfile.mkdtemp()))
    client.add(Add("same", [1], SamplingParams()))
    with pytest.raises(ValueError, match="already in flight"):
        client.add(Add("same", [1], SamplingParams()))


# -- the engine process: ordering while loading, snapshots, OOM, TP failure ------------------------

def test_an_abort_right_behind_its_add_while_loading_is_never_overtaken(tiny_model):
    from engines.dist import SingleProcess
    from engines.process.serve import EngineProcess

    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model)))
    proc = EngineProcess(config, tempfile.mkdtemp(), SingleProcess())
    proc._on_message(Add("x", [1], SamplingParams()))  # arrives while loading: held
    assert proc.state == STATE_LOADING
    received = []

    class Engine:
        def submit(self, msg):
            received.append(msg)
            if len(received) == 1:  # while the held Add is handed over, the IO thread brings its Abort
                late = threading.Thread(target=proc._on_message, args=(Abort("x"),))
                late.start()
                late.join(0.2)  # with the lock held it cannot get through before the Add is in

    proc.become_ready(Engine())
    wait_for(lambda: len(received) == 2, 5, "the abort")
    assert [type(m).__name__ for m in received] == ["Add", "Abort"]


def test_out_of_memory_in_a_step_is_logged_with_the_request_ids(caplog):
    from engines.dist import SingleProcess
    from engines.loop.engine_loop import EngineLoop

    class Loop(EngineLoop):
        num_waiting = 0
        has_work = add = abort = step = measure = lambda *a: None

    published = []
    loop = Loop(LmiConfig(model=ModelConfig(local_dir=".")), published.extend, SingleProcess())
    with caplog.at_level(logging.ERROR):
        loop.fail_step(["req-a", "req-b"], MemoryError("no room"))
    assert "out of memory" in caplog.text and "req-a" in caplog.text and "req-b" in caplog.text
    assert [o.error_code for o in published] == [507, 507]


def test_health_is_a_snapshot_measured_on_the_loop_thread(tiny_model):
    from engines.dist import SingleProcess
    from engines.loop.paged_engine import PagedEngine

    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model), dtype="fp32"),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, kv_cache_memory="4MiB"))
    engine = PagedEngine(config, lambda outs: None, SingleProcess())
    engine.load()
    measured_on = set()
    measure = engine.measure
    engine.measure = lambda: (measured_on.add(threading.get_ident()), measure())[1]
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,))
    loop.start()
    try:
        engine.submit(Add("h", [1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True)))
        wait_for(lambda: engine.health("ready").num_running == 1, 10, "the snapshot to show the request")
        for _ in range(200):  # another thread reads while the loop steps
            assert engine.health("ready").state == "ready"
    finally:
        stop.set()
        loop.join()
    assert measured_on == {loop.ident}


# -- servers ---------------------------------------------------------------------------------------

PAGED = """
engine=Python
option.rolling_batch=lmi-dist
option.dtype=fp32
option.kv_cache_memory=2MiB
option.max_rolling_batch_size=16
http_workers=2
http_threads=4
job_queue_size=2000
max_inputs_per_request=1000
max_input_chars=200000
max_request_size=4000000
"""


@pytest.fixture(scope="module")
def paged(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("reliability"), PAGED, tiny_model)


def _greedy(server, prompt: str, n: int = 8) -> str:
    resp = server.post({"inputs": prompt, "parameters": {"max_new_tokens": n}})
    assert resp.status_code == 200, resp.text
    return resp.json()["generated_text"]


def test_a_thousand_inputs_in_one_request_are_all_answered(paged):
    prompts = [f"The river {i}" for i in range(1000)]
    resp = paged.post({"inputs": prompts, "parameters": {"max_new_tokens": 1}}, timeout=300)
    assert resp.status_code == 200, resp.text[:500]
    body = resp.json()
    assert len(body) == 1000 and all(isinstance(b["generated_text"], str) for b in body)
    too_many = paged.post({"inputs": prompts + ["one more"], "parameters": {"max_new_tokens": 1}})
    assert too_many.status_code == 400 and "max_inputs_per_request" in too_many.json()["error"]


def test_two_requests_with_the_same_client_id_are_not_cross_wired(paged):
    prompts = ["Once upon a time", "The river ran"]
    expected = [_greedy(paged, p, 40) for p in prompts]
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            resps = list(pool.map(lambda p: paged.post({"inputs": p, "parameters": {"max_new_tokens": 40}},
                                                       headers={"X-Request-Id": "shared-id"}), prompts))
        assert [r.json()["generated_text"] for r in resps] == expected
        assert [r.headers["X-Request-Id"] for r in resps] == ["shared-id", "shared-id"]  # echoed only


def test_ping_answers_within_2_s_while_every_request_thread_is_busy(paged):
    # 8 request threads in all (2 workers x 4): 48 long requests hold them all and queue behind them
    def generate(i):
        return paged.post({"inputs": f"Long story {i}", "parameters": {"max_new_tokens": 300, "ignore_eos": True}},
                          timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        pending = [pool.submit(generate, i) for i in range(48)]
        wait_running(paged, 8, timeout=30)
        latencies = []
        for _ in range(10):
            started = time.monotonic()
            resp = requests.get(paged.url + "/ping", timeout=10)
            latencies.append(time.monotonic() - started)
            assert resp.status_code == 200
            time.sleep(0.1)
        assert max(latencies) < 2.0, latencies
        assert all(f.result() == 200 for f in pending)


def _raw_post(server, body: bytes, headers: str = "Content-Type: application/json\r\n") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\n" + headers.encode() +
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_a_plain_request_is_aborted_when_its_client_leaves_while_tokens_flow(paged):
    # tokens arrive every few ms, faster than the 50 ms poll: the old check never ran
    wait_idle(paged)
    sock = _raw_post(paged, json.dumps({"inputs": "The", "parameters": {"max_new_tokens": 1000,
                                                                        "ignore_eos": True}}).encode())
    wait_running(paged, 1)
    sock.close()
    closed = time.monotonic()
    wait_idle(paged, timeout=10)
    assert time.monotonic() - closed < 2.0  # 1000 tokens would take several seconds


def test_prompts_over_the_character_limit_are_400_before_tokenizing(paged):
    huge = "word " * 700_000  # 3.5 MB, under max_request_size
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        inflight = pool.submit(paged.post, {"inputs": "The river", "parameters": {"max_new_tokens": 20}})
        started = time.monotonic()
        resps = list(pool.map(lambda _: paged.post({"inputs": huge}), range(4)))
        assert time.monotonic() - started < 5.0
        assert inflight.result().status_code == 200
    for resp in resps:
        assert resp.status_code == 400 and "max_input_chars" in resp.json()["error"]
    assert ping(paged)["status"] == "healthy"


def test_tokenizing_a_long_prompt_lets_other_threads_run(tiny_model):
    from handlers.tokenizer import TextTokenizer

    tok = TextTokenizer(str(tiny_model))
    text = "The river ran under the old stone bridge. " * 25_000  # ~1M characters
    ticks, done = [0], threading.Event()

    def ticker():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    thread = threading.Thread(target=ticker)
    thread.start()
    started = time.monotonic()
    tok.encode(text)
    elapsed = time.monotonic() - started
    done.set()
    thread.join()
    assert ticks[0] >= 0.5 * elapsed / 0.005, (ticks[0], elapsed)  # the GIL was free while it ran


@pytest.mark.parametrize("params", [
    {"do_sample": True, "temperature": 1e-45},
    {"do_sample": True, "top_p": 1e-300},
    {"do_sample": True, "repetition_penalty": 1e-300},
    {"do_sample": True, "temperature": 1e-45, "top_p": 1e-300, "repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300},
])
def test_extreme_sampling_values_give_valid_json_and_finite_log_probs(paged, params):
    resp = paged.post({"inputs": "The river", "parameters": {**params, "max_new_tokens": 5, "details": True}})
    assert resp.status_code == 200, resp.text
    body = strict_json(resp.text)
    assert all(isinstance(t["log_prob"], float) and t["log_prob"] <= 0 for t in body["details"]["tokens"])
    if params.get("temperature") == 1e-45 and "repetition_penalty" not in params:  # below 1e-5: greedy
        assert body["generated_text"] == _greedy(paged, "The river", 5)


@pytest.mark.parametrize("body,message", [
    ({"inputs": "a", "parameters": {"seed": 2**64}}, '"parameters.seed" must be <='),
    ({"inputs": "a", "parameters": {"top_k": 2**64}}, '"parameters.top_k" must be <='),
    ({"inputs": "a", "parameters": {"max_new_tokens": 10**30}}, '"parameters.max_new_tokens" must be <='),
    ({"inputs": "a", "parameters": {"stop_token_ids": [2**64]}}, '"parameters.stop_token_ids" must be a list'),
    ({"inputs": "a", "parameters": {"temperature": 10**400}}, '"parameters.temperature" must be a finite'),
])
def test_out_of_range_numbers_are_400(paged, body, message):
    resp = paged.post(body)
    assert resp.status_code == 400 and message in strict_json(resp.text)["error"], resp.text


@pytest.mark.parametrize("raw,message", [
    (b"[" * 10_000 + b"]" * 10_000, "nested too deeply"),
    (b'{"inputs": "\\ud800"}', "lone surrogate"),
    (b'{"inputs": "a", "parameters": {"stop_sequences": ["\\udfff"]}}', "lone surrogate"),
    (b'{"inputs": "a", "parameters": {"temperature": NaN}}', "not valid JSON"),
])
def test_hostile_bodies_are_400(paged, raw, message):
    resp = requests.post(paged.url + "/invocations", data=raw, headers={"Content-Type": "application/json"},
                         timeout=30)
    assert resp.status_code == 400 and message in strict_json(resp.text)["error"], resp.text


def _chunked(server, chunks: list[bytes]) -> tuple[int, dict]:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + b"".join(chunks))
    data = b""
    sock.settimeout(30)
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, strict_json(body.decode()) if body.strip() else {}


def test_a_bad_chunk_size_is_400(paged):
    status, body = _chunked(paged, [b"zz\r\n{}\r\n0\r\n\r\n"])
    assert status == 400, body


def test_a_chunked_body_over_the_limit_is_413(paged):
    piece = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    status, body = _chunked(paged, [b'%x\r\n{"inputs": "\r\n' % len(b'{"inputs": "')] + [chunk] * 64 + [b"0\r\n\r\n"])
    assert status == 413 and "max_request_size" in body["error"], body


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def test_server_processes_run_with_two_malloc_arenas(paged):
    """RSS creep under load (issue: engine +6.4 % after warm-up) is capped with MALLOC_ARENA_MAX."""
    envs = []
    for pid in _descendants(paged.proc.pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            envs.append(dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv))
    assert len(envs) >= 3  # engine, gunicorn master, its workers
    assert all(e.get(b"MALLOC_ARENA_MAX") == b"2" for e in envs), envs


def test_the_server_is_healthy_and_greedy_after_all_of_it(paged, hf):
    wait_idle(paged)
    ids = paged.post({"inputs": "The river", "parameters": {"max_new_tokens": 12, "details": True}}).json()
    assert [t["id"] for t in ids["details"]["tokens"]] == hf("The river", 12)
