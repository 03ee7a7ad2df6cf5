"""Scheduling to a service level (pure Python, synthetic requests, a simulated clock): priority order,
preemption of the lowest priority first, tenants' fair shares under a flood, deadlines that shed
exactly the requests that cannot start in time, and a TPOT target held under a step-time model."""

from __future__ import annotations

import math
import zlib

import pytest

from engines.core.forecast import start_step
from engines.core.slo import FairShare, Pacer, ServiceLevel, Shed, StepTimes
from engines.core.request import Request
from tests.test_scheduler import EOS, make, step
from engines.sampling_params import SamplingParams


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, prompt: int = 4, max_new: int = 4, priority: int = 0, tenant: str = "",
        deadline: float | None = None, arrival: int = 0) -> Request:
    first = 2 + zlib.crc32(rid.encode()) % 9  # prompts differ: no prefix hits between requests
    return Request(rid, [first] + list(range(2, 1 + prompt)), SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                   frozenset({EOS}), arrival, priority=priority, tenant=tenant, deadline=deadline)


def admitted_order(sched, runner, limit=1000) -> list[str]:
    order = []
    for _ in range(limit):
        if not sched.has_unfinished:
            return order
        plan, _ = step(sched, runner)
        order += [n.request_id for n in plan.new_requests if n.request_id not in order]
    raise AssertionError("no progress")


def test_priority_admits_by_priority_then_arrival_and_fcfs_by_arrival():
    for policy, want in (("priority", ["b", "d", "a", "c"]), ("fcfs", ["a", "b", "c", "d"])):
        sched, runner = make(seqs=1, slo=ServiceLevel(policy))
        for i, (rid, p) in enumerate((("a", 2), ("b", 0), ("c", 2), ("d", 0))):
            sched.add(req(rid, priority=p, arrival=i))
        assert admitted_order(sched, runner) == want


def test_a_higher_priority_arrival_preempts_the_lowest_priority_newest_running_request():
    sched, runner = make(seqs=3, slo=ServiceLevel("priority"))
    for i, (rid, p) in enumerate((("low-old", 2), ("mid", 1), ("low-new", 2))):
        sched.add(req(rid, max_new=50, priority=p, arrival=i))
    step(sched, runner)
    assert [r.request_id for r in sched.running] == ["mid", "low-old", "low-new"]  # key order: last goes first
    sched.add(req("urgent", max_new=50, priority=0, arrival=3))
    plan, _ = step(sched, runner)
    assert plan.preempted_ids == ["low-new"]
    assert [n.request_id for n in plan.new_requests] == ["urgent"]  # admitted in the same step
    assert [r.request_id for r in sched.running] == ["urgent", "mid", "low-old"]
    assert sched.slo.num_priority_preemptions == 1
    sched.add(req("same", max_new=50, priority=2, arrival=4))  # no lower priority than its own runs: waits
    plan, _ = step(sched, runner)
    assert not plan.preempted_ids and [r.request_id for r in sched.waiting] == ["low-new", "same"]


def test_priority_preemption_when_blocks_run_out_takes_the_lowest_priority():
    # 8 blocks of 4 tokens: two requests of 12 + 4 tokens fill them
    sched, runner = make(num_blocks=8, block_size=4, seqs=4, slo=ServiceLevel("priority"))
    sched.add(req("low", prompt=12, max_new=5, priority=5, arrival=0))
    sched.add(req("mid", prompt=12, max_new=5, priority=3, arrival=1))
    step(sched, runner)
    sched.add(req("high", prompt=12, max_new=5, priority=0, arrival=2))
    plan, _ = step(sched, runner)
    assert plan.preempted_ids == ["low"] and "high" in plan.scheduled_ids
    finished = []
    for _ in range(100):
        if not sched.has_unfinished:
            break
        _, produced = step(sched, runner)
        finished += [r.request_id for r in produced if r.is_finished]
    assert finished == ["mid", "high", "low"] or finished[-1] == "low"
    assert sched.block_manager.num_free_blocks == 8


def test_a_tenants_flood_does_not_starve_the_others():
    sched, runner = make(seqs=2, slo=ServiceLevel("fcfs", fair_share=FairShare()))
    for i in range(60):
        sched.add(req(f"flood{i}", tenant="flood", arrival=i))
    for _ in range(3):
        step(sched, runner)
    for i in range(10):  # arrives behind 57 waiting requests of the flood
        sched.add(req(f"quiet{i}", tenant="quiet", arrival=100 + i))
    order = admitted_order(sched, runner)
    quiet = [i for i, rid in enumerate(order) if rid.startswith("quiet")]
    # served alternately with the flood (equal token shares), not after it: the 10th within 21 admissions
    assert quiet[-1] < 22, order[:25]
    assert all(b - a <= 3 for a, b in zip(quiet, quiet[1:])), quiet
    m = sched.slo.metrics(sched.waiting, sched.running)
    assert m["tenant/admitted_requests/quiet"] == 10 and m["tenant/admitted_requests/flood"] == 60


def test_fair_share_tags_split_tokens_evenly_between_backlogged_tenants():
    fair = FairShare()
    tags = sorted([(fair.tag("a", 10), "a") for _ in range(10)] + [(fair.tag("b", 30), "b") for _ in range(4)])
    served = {"a": 0, "b": 0}
    for tag, tenant in tags[:8]:  # the first 8 admissions: tokens stay within one request of even
        served[tenant] += 10 if tenant == "a" else 30
    assert abs(served["a"] - served["b"]) <= 30


def test_start_step_gives_each_request_ahead_the_first_row_to_free():
    assert start_step([5, 10], 1, [3, 3, 3]) == 6  # rows free at 0, 5, 10: 0+3, then 3+3, then 5 →
    assert start_step([], 2, []) == 0
    assert start_step([7], 0, []) == 7


def test_deadlines_shed_exactly_the_requests_that_cannot_start_in_time():
    clock = Clock()
    slo = ServiceLevel("fcfs", clock=clock)
    for _ in range(16):  # measured: a step takes 0.1 s
        slo.step_times.observe(2, 2, 10, 0.1)
    sched, runner = make(seqs=2, tokens=64, slo=slo)
    sched.add(req("r0", max_new=10, arrival=0))
    sched.add(req("r1", max_new=20, arrival=1))
    step(sched, runner)  # both run: r0 has 9 steps left, r1 19
    # a third starts when r0 ends, in 9 steps (0.9 s): it needs 0.9 s + the 0.1 s step of its prefill
    with pytest.raises(Shed) as shed:
        sched.add(req("late", deadline=clock.now + 0.99, arrival=2))
    assert shed.value.retry_after_s == pytest.approx(0.9)
    sched.add(req("in-time", max_new=4, deadline=clock.now + 1.01, arrival=3))
    # behind in-time (4 steps from step 9: its prefill samples its first token), a row frees at step 13
    with pytest.raises(Shed):
        sched.add(req("late2", deadline=clock.now + 1.39, arrival=4))
    sched.add(req("ok2", deadline=clock.now + 1.41, arrival=5))
    assert [r.request_id for r in sched.waiting] == ["in-time", "ok2"] and slo.num_shed == 2
    # while waiting: shed when a step from now would pass the deadline (the engine answers 503)
    clock.now += 0.95
    assert [r.request_id for r in sched.take_expired()] == ["in-time"]
    assert [r.request_id for r in sched.waiting] == ["ok2"] and "in-time" not in sched.requests
    sched.check_invariants()


def test_no_deadline_is_shed_before_a_step_was_measured():
    sched, runner = make(seqs=1, slo=ServiceLevel("fcfs", clock=Clock()))
    sched.add(req("a", max_new=100))
    sched.add(req("b", deadline=sched.slo.clock() + 0.001))  # nothing to estimate from: waits
    assert sched.num_waiting == 2


def test_step_times_fits_the_linear_cost_of_a_step():
    times = StepTimes()
    for n in range(1, 40):
        times.observe(n * 3, n, n * 100, 0.004 + 0.0005 * n * 3 + 0.001 * n + 0.002 * n / 10)
    assert times.predict(30, 10, 1000) == pytest.approx(0.004 + 0.015 + 0.01 + 0.002, rel=1e-6)


def test_tpot_target_holds_decode_steps_under_it_in_a_simulated_step_time_model():
    """Simulated host: a step costs 4 ms + 0.3 ms a token + 1.5 ms a request + 1 ms per 1000 cached
    tokens. Without a target 24 requests decode together (about 50 ms a step); with 25 ms the batch and
    the prefill chunks shrink so that the steps stay under it."""
    def cost(plan, sched) -> float:
        seqs = len(plan.scheduled)
        context = sum(sched.requests[rid].num_tokens for rid in plan.scheduled_ids if rid in sched.requests)
        return 0.004 + 0.0003 * plan.total_num_scheduled_tokens + 0.0015 * seqs + 0.001 * context / 1000

    def run(target_s: float | None) -> tuple[list[float], int, float]:
        times = StepTimes()
        slo = ServiceLevel("fcfs", pacer=Pacer(target_s, times) if target_s else None)
        sched, runner = make(num_blocks=4096, block_size=16, seqs=24, tokens=512, model_len=2048, slo=slo)
        for i in range(48):
            sched.add(req(f"r{i}", prompt=200, max_new=40, arrival=i))
        steps, elapsed, tokens = [], 0.0, 0
        while sched.has_unfinished:
            plan = sched.schedule()
            seconds = cost(plan, sched)
            times.observe(plan.total_num_scheduled_tokens, len(plan.scheduled),
                          sum(sched.requests[r].num_tokens for r in plan.scheduled_ids), seconds)
            produced = sched.update(plan, runner.execute(plan))
            elapsed += seconds
            tokens += sum(1 for _ in produced)
            steps.append(seconds)
        return steps, tokens, elapsed

    free_steps, tokens, free_elapsed = run(None)
    paced_steps, paced_tokens, paced_elapsed = run(0.025)
    assert tokens == paced_tokens == 48 * 40
    warm = sorted(paced_steps[8:])  # the model predicts nothing before its 8th step
    assert warm[int(0.9 * len(warm))] <= 0.025 * 1.1
    assert sorted(free_steps)[int(0.9 * len(free_steps))] > 0.035  # the target changed something
    assert paced_elapsed < free_elapsed * 2  # and the host still serves (slower, by the cap)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        ServiceLevel("lifo")



def test_priorities_and_their_preemptions_leave_greedy_tokens_as_hf_generate(tiny_model, hf):
    """The real paged engine on the tiny model: later requests of higher priority preempt running ones
    (recomputed later); every request still gets HF generate's greedy tokens, and the blocks come back."""
    from engines.protocol import Slo
    from tests.support import drive_engine, output_tokens, paged_engine

    engine = paged_engine(tiny_model, max_num_seqs=2, scheduling_policy="priority")
    prompts = [[1] + list(range(30 + i, 40 + 2 * i)) for i in range(6)]
    adds = [(f"p{i}", p, SamplingParams(max_new_tokens=12, ignore_eos=True), None, Slo(priority=5 - i))
            for i, p in enumerate(prompts)]  # each arrival outranks everything before it
    outs = drive_engine(engine, adds, join_every=2)
    assert engine.scheduler.slo.num_priority_preemptions >= 3
    for i, p in enumerate(prompts):
        assert output_tokens(outs[f"p{i}"]) == hf(p, 12), i
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


SLO_SERVER = ("engine=Python\noption.dtype=fp32\noption.kv_cache_memory=8MiB\noption.max_rolling_batch_size=1\n"
              "option.scheduling_policy=priority\noption.fair_share_key=X-Tenant\noption.max_model_len=2048\n")


def test_a_server_serves_priorities_sheds_what_cannot_start_and_counts_tenants(tiny_model, start_server):
    import json
    import threading
    import time

    import requests

    from tests.support import wait_for, wait_running

    server = start_server(SLO_SERVER, tiny_model)
    url = server.url + "/invocations"
    short = {"inputs": "The quick fox", "parameters": {"max_new_tokens": 6, "details": True}}
    want = requests.post(url, json=short, timeout=60).json()
    long_body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 1500, "ignore_eos": True,
                                                               "priority": 1}, "stream": True}
    lines: list[dict] = []
    done = threading.Event()

    def stream():  # until the checks are done: then the client goes away (the engine aborts it)
        with requests.post(url, json=long_body, stream=True, timeout=120, headers={"X-Tenant": "batch"}) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))
                if done.is_set():
                    return

    worker = threading.Thread(target=stream)
    worker.start()
    wait_running(server, 1)
    # one row, held for ~1500 steps: a request that must start within 0.2 s is shed at once
    started = time.monotonic()
    shed = requests.post(url, json={"inputs": "Hi", "parameters": {"timeout": 0.2}}, timeout=30)
    assert shed.status_code == 503 and time.monotonic() - started < 1.0, shed.text
    assert int(shed.headers["Retry-After"]) >= 1 and "cannot start the request in time" in shed.json()["error"]
    late = requests.post(url, json={"inputs": "Hi"}, headers={"X-Request-Timeout": "0.2"}, timeout=30)
    assert late.status_code == 503
    # priority 0 preempts the running priority-1 request, and gets the same greedy answer as alone
    urgent = requests.post(url, json={**short, "parameters": {**short["parameters"], "priority": 0}},
                           headers={"X-Tenant": "interactive"}, timeout=60)
    assert urgent.status_code == 200 and urgent.json() == want
    assert worker.is_alive()  # the preempted request goes on afterwards
    num_before = len(lines)
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert 'lmi_tenant_admitted_requests_total{tenant="interactive"} 1.0' in metrics
    assert "lmi_priority_preemptions_total 1.0" in metrics and "lmi_requests_shed_total 2.0" in metrics
    bad = requests.post(url, json={"inputs": "x", "parameters": {"priority": "high"}}, timeout=10)
    assert bad.status_code == 400 and "priority" in bad.json()["error"]
    bad = requests.post(url, json={"inputs": "Hi"}, headers={"X-Request-Timeout": "soon"}, timeout=10)
    assert bad.status_code == 400 and "X-Request-Timeout" in bad.json()["error"]
    wait_for(lambda: len(lines) > num_before + 5, 30, "the preempted request streaming again")
    done.set()
    worker.join(timeout=30)
    assert all("token" in line for line in lines) and not worker.is_alive()


def test_service_level_keys_need_the_paged_engine_and_reach_its_config(tiny_model):
    from container import config as cfgmod
    from container.keys import ConfigError

    def build(props):
        return cfgmod.build(cfgmod.resolve(props, {}), local_dir=str(tiny_model),
                            spec=cfgmod.read_spec(str(tiny_model), None), num_gpus=0, num_cpus=2, port=8080)

    sched = build({"option.scheduling_policy": "priority", "option.target_tpot_ms": "80",
                   "option.max_queue_wait_ms": "1500", "option.fair_share_key": "X-Tenant"}).scheduler
    assert (sched.scheduling_policy, sched.target_tpot_ms, sched.max_queue_wait_ms, sched.fair_share_key) == \
        ("priority", 80.0, 1500.0, "X-Tenant")
    with pytest.raises(ConfigError, match="option.target_tpot_ms=80.0 needs the paged engine"):
        build({"option.rolling_batch": "scheduler", "option.target_tpot_ms": "80"})
    with pytest.raises(ConfigError, match="option.scheduling_policy"):
        build({"option.scheduling_policy": "lifo"})


def test_a_deadline_counts_the_prompt_tokens_queued_ahead_even_with_rows_free():
    clock = Clock()
    slo = ServiceLevel("fcfs", clock=clock)
    for _ in range(16):
        slo.step_times.observe(2, 2, 10, 0.1)
    sched, _ = make(num_blocks=512, seqs=8, tokens=64, slo=slo)
    for i in range(3):  # 3 × 100 prompt tokens ahead, 64 a step: the 4th one's 4 tokens end in step 5
        sched.add(req(f"long{i}", prompt=100, arrival=i))
    with pytest.raises(Shed):
        sched.add(req("late", deadline=clock.now + 0.45, arrival=3))
    sched.add(req("in-time", deadline=clock.now + 0.55, arrival=4))
    assert [r.request_id for r in sched.waiting][-1] == "in-time"


def test_a_target_below_one_requests_step_still_serves_one_request_at_a_time():
    """A step costs 10 ms a request and 0.01 ms a token; the target is 1 ms: unreachable. The batch is
    held at one request, which still gets all its tokens (an empty batch always takes one)."""
    times = StepTimes()
    slo = ServiceLevel("fcfs", pacer=Pacer(0.001, times))
    sched, runner = make(seqs=8, tokens=64, slo=slo)
    sched.add(req("warm", prompt=40, max_new=20))  # the model is fitted before the others arrive
    for n in range(400):
        if n == 20:
            for i in range(4):
                sched.add(req(f"r{i}", prompt=40, max_new=5, arrival=1 + i))
        if not sched.has_unfinished and n > 20:
            break
        plan = sched.schedule()
        times.observe(plan.total_num_scheduled_tokens, len(plan.scheduled), 0,
                      0.01 * len(plan.scheduled) + 0.00001 * plan.total_num_scheduled_tokens)
        sched.update(plan, runner.execute(plan))
        assert sched.num_running <= max(1, times.num_observed)
    assert not sched.has_unfinished


def test_the_io_threads_screen_counts_what_it_let_through_until_a_forecast_has_it():
    from engines.core.forecast import Forecast, Queued, Screen

    screen = Screen()
    for _ in range(3):  # arrivals 0, 1, 2 go on to the inbox, each to hold a row for 10 steps
        screen.let_through((0, math.inf, math.inf), 10, 4)
    # the engine has taken arrivals 0 and 1 (its forecast queues one of them: the other was refused)
    f = Forecast(0.1, rows=[5], free_rows=0, running_prompts=0, queue=[Queued((0, 0.0, 7), 10, 4)], budget=64,
                 num_taken=2)
    start, first = screen.first_token_s(f, (0, math.inf, math.inf), 4)
    # one row, free in 5 steps; two requests ahead (the queued one, arrival 2 still in the inbox)
    assert (start, first) == pytest.approx((2.5, 2.6))
    assert screen.first_token_s(f._replace(num_taken=3, queue=[]), (0, math.inf, math.inf), 4) == \
        pytest.approx((0.5, 0.6))
    # under priority only equal or higher priorities are ahead
    assert screen.first_token_s(f._replace(queue=[Queued((1, 0.0, 7), 10, 4)]), (0, math.inf, math.inf), 4) == \
        pytest.approx((0.5, 0.6))
