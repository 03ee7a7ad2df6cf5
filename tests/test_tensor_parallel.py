"""Tensor parallelism under real `mpirun`: TP=2 equals TP=1 token for token; a dead rank ends the server."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import pytest
import requests

from container.model_maker import corpus_lines, make_model
from engines.config import ENGINE_PAGED, ENGINE_ROLLING, LmiConfig, ModelConfig, SchedulerConfig
from engines.protocol import Add
from engines.sampling_params import SamplingParams
from tests.test_lifecycle import _alive, _cmdline, _descendants
from tests.support import hf_oracle, ids_of, wait_for

ENGINES = {"scheduler": ENGINE_ROLLING, "lmi-dist": ENGINE_PAGED}
SAMPLED = SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.3, top_k=50, seed=77)
PROMPTS = [line[: 10 + 9 * i] for i, line in enumerate(corpus_lines()[40:46])]


def properties(rolling_batch: str, tp: int = 2) -> str:
    return (f"engine=MPI\noption.tensor_parallel_degree={tp}\noption.rolling_batch={rolling_batch}\n"
            "option.dtype=fp32\noption.kv_cache_memory=32MiB\noption.max_rolling_batch_prefill_tokens=64\n")


@pytest.fixture(scope="module", params=[4, 2, 1], ids=lambda n: f"{n}kv")
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / f"llama-{request.param}kv"
    make_model(str(out), arch="llama", size="tiny", seed=10 + request.param,
               overrides={"num_key_value_heads": request.param})
    return out


def single_rank_tokens(model_dir, kind: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """The same request through the same engine at TP=1, in this process."""
    from engines.process.serve import build_engine
    from engines.dist import SingleProcess

    config = LmiConfig(model=ModelConfig(local_dir=str(model_dir), dtype="fp32"),
                       scheduler=SchedulerConfig(engine_kind=kind, kv_cache_memory="32MiB"))
    outputs = []
    engine = build_engine(config, outputs.extend, SingleProcess())
    engine.load()
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,))
    loop.start()
    engine.submit(Add("r", prompt, params))
    deadline = time.monotonic() + 60
    while not (outputs and outputs[-1].finished) and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    loop.join()
    return [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize("rolling_batch", list(ENGINES))
def test_tp2_equals_tp1_token_for_token(model, rolling_batch, start_server):
    server = start_server(properties(rolling_batch), model)
    # mpirun forwards a rank's output on its own schedule: wait for the line, do not race it
    wait_for(lambda: "rank 1 ready" in server.log(), 10, "rank 1's ready line")
    oracle = hf_oracle(model)  # HF generate = our TP=1 output (tests/test_server_*.py)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = list(pool.map(lambda p: server.post({"inputs": p, "parameters": {
            "max_new_tokens": 20, "details": True}}).json(), PROMPTS))
    for prompt, body in zip(PROMPTS, bodies):
        assert ids_of(body) == oracle(prompt, 20)
    from handlers.tokenizer import TextTokenizer

    prompt = "Once upon a time"
    sampled = server.post({"inputs": prompt, "parameters": {**{k: getattr(SAMPLED, k) for k in (
        "max_new_tokens", "do_sample", "temperature", "top_k", "seed")}, "details": True}}).json()
    expected = single_rank_tokens(model, ENGINES[rolling_batch], TextTokenizer(str(model)).encode(prompt), SAMPLED)
    assert ids_of(sampled) == expected


def test_tp2_with_compiled_decode_steps_equals_hf(tiny_model, start_server, hf):
    """option.cpu_compile at TP=2: each rank compiles its shard's decode step (the all-reduces stay
    outside the compiled graphs); greedy tokens are still HF's."""
    server = start_server(properties("lmi-dist") + "option.cpu_compile=true\noption.max_rolling_batch_size=4\n",
                          tiny_model)
    wait_for(lambda: "rank 1 ready" in server.log(), 10, "rank 1's ready line")
    assert "decode steps: inductor" in server.log()
    oracle = hf
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # 6 requests, 4 at a time: buckets 1..4
        bodies = list(pool.map(lambda p: server.post({"inputs": p, "parameters": {
            "max_new_tokens": 12, "details": True}}).json(), PROMPTS))
    for prompt, body in zip(PROMPTS, bodies):
        assert ids_of(body) == oracle(prompt, 12)


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    ranks = {}
    for pid in _descendants(launcher_pid):
        if "engines.process.serve" not in _cmdline(pid):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"OMPI_COMM_WORLD_RANK" in env:
            ranks[int(env[b"OMPI_COMM_WORLD_RANK"])] = pid
    return ranks


def _seconds_until_ping_is_503(server, since: float, limit: float, gone_counts: bool = False) -> float | None:
    """Seconds from `since` until /ping answered 503 (or, with gone_counts, refused the connection)."""
    while time.monotonic() - since < limit:
        try:
            if requests.get(server.url + "/ping", timeout=2).status_code == 503:
                return time.monotonic() - since
        except requests.ConnectionError:
            return time.monotonic() - since if gone_counts else None
        time.sleep(0.05)
    return None


def test_killing_rank_1_turns_ping_503_and_stops_the_server(tiny_model, start_server):
    server = start_server(properties("scheduler"), tiny_model)
    group = _descendants(server.proc.pid)
    ranks = _rank_pids(server.proc.pid)
    assert set(ranks) == {0, 1}
    # a request in flight when the rank dies fails with 424
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.post, {"inputs": "The", "parameters": {"max_new_tokens": 1000,
                                                                            "ignore_eos": True}})
        time.sleep(0.3)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        saw_503 = _seconds_until_ping_is_503(server, killed, limit=2.0)
        assert saw_503 is not None and saw_503 < 2.0
        resp = pending.result(timeout=10)
    assert resp.status_code == 424, resp.text
    assert server.proc.wait(timeout=10) != 0
    assert time.monotonic() - killed < 10
    assert _alive(group) == [], [_cmdline(p) for p in _alive(group)]


def test_a_failed_step_at_tp2_turns_ping_503_at_once_and_stops_the_server(tiny_model, start_server):
    """A step that fails on rank 0 leaves the ranks out of step: the engine must say so and go down,
    not keep answering /ping 200 until the watchdog fires."""
    from handlers.engine_client import EngineClient
    from engines.process.rundir import engine_socket_path

    server = start_server(properties("lmi-dist"), tiny_model)
    (engine,) = [p for p in _descendants(server.proc.pid) if "engines.process.serve" in _cmdline(p)
                 and "mpirun" not in _cmdline(p).split()[0]][:1]
    run_dir = _cmdline(engine).split("--run-dir ", 1)[1].split()[0]
    # sampling fails on rank 0 only (top_n_tokens beyond the vocabulary), after rank 1 ran the forward
    client = EngineClient(engine_socket_path(run_dir))
    outputs = client.add(Add("boom", [1, 2, 3], SamplingParams(max_new_tokens=4, top_n_tokens=10**6)))
    out = outputs.get(timeout=30)
    failed = time.monotonic()
    assert out.error_code == 424 and out.finished
    saw_503 = _seconds_until_ping_is_503(server, failed, limit=2.0, gone_counts=True)
    assert saw_503 is not None and saw_503 < 1.5, saw_503
    assert server.proc.wait(timeout=10) != 0
    assert time.monotonic() - failed < 10
    assert "step 1 failed with tensor parallelism" in server.log()


def test_hf_model_id_with_sm_num_gpus_2_starts_a_tp2_mpi_engine(tiny_model, start_server, hf):
    """The usual SageMaker deployment: no properties file, only the environment."""
    import openai
    import torch

    server = start_server(None, None, env={"HF_MODEL_ID": str(tiny_model), "SM_NUM_GPUS": "2",
                                           "OPTION_DTYPE": "fp32", "OPTION_KV_CACHE_MEMORY": "32MiB"})
    wait_for(lambda: "rank 1 ready" in server.log(), 10, "rank 1's ready line")
    assert "engine=MPI" in server.log()
    prompt = "Once upon a time"
    lmi = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 10, "details": True,
                                                        "decoder_input_details": True}}).json()
    assert ids_of(lmi) == hf(prompt, 10)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0)
    assert out.choices[0].text == lmi["generated_text"]
    # the prompt's log-probs come from rank 0's gathered logits
    ids = hf.tokenizer(prompt).input_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), -1)
    prefill = lmi["details"]["prefill"]
    assert [t["id"] for t in prefill] == ids and prefill[0]["log_prob"] is None
    assert all(abs(t["log_prob"] - lp[i, ids[i + 1]].item()) < 1e-4 for i, t in enumerate(prefill[1:]))


@pytest.mark.parametrize("speed", ["ngram", "draft", "multi_step"])
def test_tp2_with_speculation_or_multi_step_equals_hf(tiny_model, start_server, hf, speed, tmp_path):
    """Speculative decoding (the proposals and the tokens each verification emits reach rank 1 in the
    step) and multi-step decode (rank 0's sampled tokens go to rank 1 between the steps) at TP=2:
    greedy tokens are HF's under concurrency; a seeded sampled request reproduces itself."""
    extra = {"ngram": "option.speculative_method=ngram\noption.num_speculative_tokens=3\n",
             "multi_step": "option.num_scheduler_steps=4\n"}.get(speed)
    if speed == "draft":
        from container.model_maker import make_draft

        make_draft(str(tiny_model), str(tmp_path / "draft"), num_layers=1)
        extra = f"option.speculative_model={tmp_path / 'draft'}\noption.num_speculative_tokens=3\n"
    server = start_server(properties("lmi-dist") + "option.max_rolling_batch_size=4\n" + extra, tiny_model)
    wait_for(lambda: "rank 1 ready" in server.log(), 10, "rank 1's ready line")
    prompts = PROMPTS + [p + " " + p for p in PROMPTS[:2]]  # repeated text: prompt lookup finds matches
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda p: server.post({"inputs": p, "parameters": {
            "max_new_tokens": 20, "details": True}}).json(), prompts))
    for prompt, body in zip(prompts, bodies):
        assert ids_of(body) == hf(prompt, 20)
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    if speed == "multi_step":
        assert "lmi_multi_step_runs_total 0.0" not in metrics
    else:
        assert "lmi_spec_decode_accepted_tokens_total 0.0" not in metrics
        assert "lmi_spec_decode_proposed_tokens_total" in metrics
    params = {k: getattr(SAMPLED, k) for k in ("max_new_tokens", "do_sample", "temperature", "top_k", "seed")}
    twice = [ids_of(server.post({"inputs": prompts[-1], "parameters": {**params, "details": True}}).json())
             for _ in range(2)]
    assert twice[0] == twice[1] and len(twice[0]) == SAMPLED.max_new_tokens
