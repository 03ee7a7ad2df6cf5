"""End to end: the paged engine behind the real server — chunked prefill, preemption, prefix caching."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import pytest
import requests

from container.model_maker import corpus_lines
from handlers.request_metrics import FLUSH_S
from handlers.tokenizer import TextTokenizer
from tests.support import ids_of, running_server, wait_idle

BLOCK = 16
PROPERTIES = f"""
engine=Python
option.rolling_batch=lmi-dist
option.max_rolling_batch_size=8
option.max_rolling_batch_prefill_tokens=48
option.kv_block_size={BLOCK}
option.enable_prefix_caching=true
option.dtype=fp32
# the tiny model keeps 512 bytes of K/V per token: 300 KiB is 37 blocks, small enough to preempt
option.kv_cache_memory=300KiB
"""


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from running_server(tmp_path_factory.mktemp("paged"), PROPERTIES, tiny_model)


def metrics(server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(lmi_[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$",
                                                              text, re.M)}


# several prompts longer than the 48-token step budget: they are prefilled in chunks
PROMPTS = [" ".join(corpus_lines()[i:i + 1 + i % 4])[: 20 + 11 * i] for i in range(20)]
MAX_NEW = [5 + 3 * i for i in range(20)]


def test_log_reports_the_kv_cache_size(server):
    assert re.search(r"paged KV cache: 37 blocks of 16 tokens = 592 tokens", server.log())


def test_greedy_under_concurrency_with_chunking_and_preemption_equals_hf(server, hf):
    def send(i):
        time.sleep(0.01 * i)
        return server.post({"inputs": PROMPTS[i], "parameters": {"max_new_tokens": MAX_NEW[i], "details": True}})

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        bodies = [r.json() for r in pool.map(send, range(20))]
    for i, body in enumerate(bodies):
        assert ids_of(body) == hf(PROMPTS[i], MAX_NEW[i]), i
    # all 20 at once (one list request: however slow the client, they arrive together), long enough
    # that 8 running rows need more than the 37 blocks: preemption is certain
    before = metrics(server)["lmi_preemptions_total"]
    burst = server.post({"inputs": PROMPTS, "parameters": {"max_new_tokens": 60, "details": True}}).json()
    assert [ids_of(b) for b in burst] == [hf(p, 60) for p in PROMPTS]
    assert metrics(server)["lmi_preemptions_total"] > before  # the cache was small enough to force preemption
    wait_idle(server)
    m = metrics(server)
    assert m["lmi_kv_cache_free_blocks"] == m["lmi_kv_cache_blocks"] == 37  # every block free again
    assert m["lmi_kv_slots_in_use"] == 0


def test_a_repeated_prompt_hits_the_prefix_cache_in_whole_blocks(server, hf):
    prompt = " ".join(corpus_lines()[30:33])  # ~90 tokens: 5 full blocks and a partial one
    first = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 4, "details": True}}).json()
    before = metrics(server)
    second = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 4, "details": True}}).json()
    after = metrics(server)
    assert ids_of(first) == ids_of(second) == hf(prompt, 4)
    hit = after["lmi_prefix_cache_hit_tokens_total"] - before["lmi_prefix_cache_hit_tokens_total"]
    assert hit > 0 and hit % BLOCK == 0


def test_streaming_and_seeded_sampling(server):
    sampled = {"inputs": "Once upon a time", "parameters": {"do_sample": True, "seed": 5, "temperature": 1.2,
                                                            "max_new_tokens": 20, "details": True}}
    alone = ids_of(server.post(sampled).json())
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(server.post, {"inputs": p, "parameters": {"max_new_tokens": 30}}) for p in PROMPTS[:5]]
        busy = pool.submit(server.post, sampled)
        assert ids_of(busy.result().json()) == alone
        [f.result() for f in noise]
    resp = requests.post(server.url + "/invocations", json=dict(sampled, stream=True), stream=True, timeout=60)
    lines = [json.loads(x) for x in resp.iter_lines() if x]
    assert [x["token"]["id"] for x in lines] == alone


def test_a_request_larger_than_the_whole_cache_is_refused_with_507(server):
    resp = server.post({"inputs": "The river", "parameters": {"max_new_tokens": 900}})
    assert resp.status_code == 507 and "cannot be served" in resp.json()["error"]
    assert requests.get(server.url + "/ping").status_code == 200


def test_a_priority_under_first_come_first_served_is_a_400_naming_the_policy(server):
    resp = server.post({"inputs": "The river", "parameters": {"priority": 3}})
    assert resp.status_code == 400 and "option.scheduling_policy=priority" in resp.json()["error"]
    ok = server.post({"inputs": "The river", "parameters": {"priority": 0, "max_new_tokens": 2}})
    assert ok.status_code == 200


def test_a_stream_refused_before_its_first_token_gets_its_real_status(server):
    # 37 blocks hold 592 tokens: ~500 + 300 fits the model's length but can never fit the cache
    prompt = " ".join(corpus_lines())[:2000]
    resp = requests.post(server.url + "/invocations", json={"inputs": prompt, "stream": True, "parameters": {
        "max_new_tokens": 300}}, stream=True, timeout=30)
    assert resp.status_code == 507, resp.text
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.json()["code"] == 507 and "cannot be served" in resp.json()["error"]


def _scrape(server) -> dict[str, float]:
    """Every sample of /metrics: name{labels} → value."""
    text = requests.get(server.url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z0-9_:]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", text, re.M)}


def _settled_scrape(server) -> dict[str, float]:
    """A scrape once every worker has flushed: nothing in flight and the same totals twice, more than
    a flush period (FLUSH_S) apart."""
    deadline = time.monotonic() + 15
    last = _scrape(server)
    while time.monotonic() < deadline:
        time.sleep(2 * FLUSH_S + 0.1)
        now = _scrape(server)
        if now == last and now.get("lmi_http_requests_in_flight") == 0:
            return now
        last = now
    raise AssertionError(f"the request metrics did not settle: {last}")


def test_request_metrics_count_every_workers_requests_with_vllm_names(server, tiny_model):
    """TTFT / TPOT / latency histograms, token counters and requests by route and status, summed over
    both HTTP workers (whichever one answers the scrape)."""
    before = _settled_scrape(server)  # earlier tests' requests may still be on their way to the files
    prompts = [PROMPTS[i] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        bodies = list(pool.map(lambda p: server.post({"inputs": p, "parameters": {"max_new_tokens": 4,
                                                                                  "details": True}}), prompts))
    assert all(b.status_code == 200 for b in bodies)
    assert server.post({"inputs": "x", "parameters": {"max_new_tokens": 0}}).status_code == 400

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    after = _settled_scrape(server)
    assert delta('lmi_http_requests_total{route="/invocations",status="200"}') == 6
    assert delta('lmi_http_requests_total{route="/invocations",status="400"}') == 1
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds"):
        assert delta(f"{name}_count") == 6, name
        assert delta(f'{name}_bucket{{le="+Inf"}}') == 6 and delta(f"{name}_sum") > 0
    assert delta("vllm:generation_tokens_total") == 24
    assert delta('vllm:request_success_total{finished_reason="length"}') == 6
    tokenizer = TextTokenizer(str(tiny_model))
    assert delta("vllm:prompt_tokens_total") == sum(len(tokenizer.encode(p)) for p in prompts)
    assert after["lmi_http_requests_in_flight"] == 0


DJL_0_29 = """
engine=MPI
option.rolling_batch=lmi-dist
option.tensor_parallel_degree=1
option.max_rolling_batch_size=8
option.max_rolling_batch_prefill_tokens=64
option.dtype=fp32
option.kv_cache_memory=1MiB
"""
LMI_V15 = """
option.rolling_batch=vllm
option.max_num_seqs=8
option.max_model_len=256
option.max_num_batched_tokens=64
option.enable_prefix_caching=true
option.dtype=fp32
option.kv_cache_memory=1MiB
"""


@pytest.mark.parametrize("properties,log_line", [
    (DJL_0_29, "max_num_seqs 8, max_num_batched_tokens 64"),
    (LMI_V15, "option.rolling_batch=vllm: serving with the paged engine"),
], ids=["djl-0.29", "lmi-v15"])
def test_properties_written_for_djl_0_29_and_lmi_v15_start_and_serve(start_server, tiny_model, hf, properties,
                                                                    log_line):
    server = start_server(properties, tiny_model)
    assert log_line in server.log() and "max_num_seqs 8, max_num_batched_tokens 64" in server.log()
    body = server.post({"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 6, "details": True}}).json()
    assert ids_of(body) == hf(PROMPTS[3], 6)
