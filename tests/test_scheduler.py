"""Scheduler: token budget, chunked prefill, FIFO admission, preemption, aborts (pure Python, a fake model).

The fake runner keeps its own state from the plans alone (as the real one must) and a fake KV cache:
slot(p) holds a key of the whole prefix up to position p, so reading a wrong block (a false prefix
hit, a block shared while still written, a block table out of date) fails the check at sampling time.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engines.core.block_manager import BlockManager
from engines.core.request import Request, Status
from engines.core.plan import StepPlan
from engines.core.scheduler import Scheduler
from engines.core.slo import FairShare, ServiceLevel
from engines.protocol import FINISH_ABORT, FINISH_EOS, FINISH_LENGTH
from engines.sampling_params import SamplingParams

EOS = 1
VOCAB = 12


def fake_token(request_id: str, position: int) -> int:
    """The fake model: the token at a position depends on the request and the position only."""
    return zlib.crc32(f"{request_id}/{position}".encode()) % VOCAB


@dataclass
class RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    keys: list[int] = field(default_factory=list)  # keys[p]: hash of token_ids[:p + 1]

    def key(self, p: int) -> int:
        while len(self.keys) <= p:
            self.keys.append(hash((self.keys[-1] if self.keys else None, self.token_ids[len(self.keys)])))
        return self.keys[p]


class FakeRunner:
    def __init__(self, bm: BlockManager):
        self.block_size = bm.block_size
        self.kv: list[int | None] = [None] * (bm.num_blocks * bm.block_size)
        self.states: dict[str, RunnerState] = {}

    def slot(self, s: RunnerState, p: int) -> int:
        return s.block_ids[p // self.block_size] * self.block_size + p % self.block_size

    def check_reads(self, s: RunnerState) -> None:
        for p in range(s.num_computed_tokens):
            assert self.kv[self.slot(s, p)] == s.key(p), f"position {p}: wrong K/V"

    def execute(self, plan: StepPlan) -> dict[str, list[int]]:
        for request_id in plan.finished_ids + plan.preempted_ids:
            del self.states[request_id]
        for new in plan.new_requests:
            assert new.request_id not in self.states
            s = RunnerState(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.check_reads(s)  # the prefix hit holds exactly these tokens
            self.states[new.request_id] = s
        for cached in plan.cached_requests:
            s = self.states[cached.request_id]
            assert s.num_computed_tokens == cached.num_computed_tokens
            assert cached.first_block <= len(s.block_ids)
            s.block_ids[cached.first_block:] = cached.new_block_ids
        sampled = {}
        for request_id, n in plan.num_scheduled_tokens.items():
            s = self.states[request_id]
            if plan.num_steps > 1:  # n decode steps, each feeding its token to the next
                assert n == plan.num_steps and s.num_computed_tokens == len(s.token_ids) - 1
                assert request_id not in plan.spec_token_ids
                assert s.num_computed_tokens + n <= len(s.block_ids) * self.block_size
                sampled[request_id] = []
                for _ in range(n):
                    self.kv[self.slot(s, s.num_computed_tokens)] = s.key(s.num_computed_tokens)
                    s.num_computed_tokens += 1
                    self.check_reads(s)
                    s.token_ids.append(fake_token(request_id, len(s.token_ids)))
                    sampled[request_id].append(s.token_ids[-1])
                continue
            draft = plan.spec_token_ids.get(request_id, [])
            end = s.num_computed_tokens + n
            assert 0 < n and end <= len(s.token_ids) + len(draft) and end <= len(s.block_ids) * self.block_size
            assert not draft or s.num_computed_tokens == len(s.token_ids) - 1
            key = None
            for p in range(s.num_computed_tokens, end):  # speculated positions hold the draft's keys
                key = s.key(p) if p < len(s.token_ids) else hash((key, draft[p - len(s.token_ids)]))
                self.kv[self.slot(s, p)] = key
            if end < len(s.token_ids):
                s.num_computed_tokens = end
                continue
            s.num_computed_tokens = len(s.token_ids)
            self.check_reads(s)
            emitted = []  # the accepted draft tokens, then the model's own
            for d in draft + [None]:
                emitted.append(fake_token(request_id, len(s.token_ids) + len(emitted)))
                if emitted[-1] != d:
                    break
            s.num_computed_tokens += len(emitted) - 1
            s.token_ids += emitted
            sampled[request_id] = emitted
        return sampled


def propose(sched: Scheduler, k: int) -> dict[str, list[int]]:
    """A fake proposer: k guesses for each running request, right two times in three (the scheduler
    keeps them for the decoding ones only)."""
    return {req.request_id: [fake_token(req.request_id, req.num_tokens + j)
                             if zlib.crc32(f"{req.request_id}/{req.num_tokens}/{j}".encode()) % 3 else VOCAB
                             for j in range(k)] for req in sched.running} if k else {}


def make(num_blocks=64, block_size=4, seqs=8, tokens=64, model_len=256, caching=True, steps=1, slo=None):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(seqs, tokens, bm, model_len, steps, service_level=slo), FakeRunner(bm)


def request(rid: str, prompt: list[int] | int, max_new=8, **sampling) -> Request:
    prompt = list(range(2, 2 + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True, **sampling),
                   frozenset({EOS}), 0)


def step(sched: Scheduler, runner: FakeRunner, k: int = 0) -> tuple[StepPlan, list[Request]]:
    plan = sched.schedule(propose(sched, k))
    assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
    assert plan.total_num_scheduled_tokens <= sched.max_num_batched_tokens * plan.num_steps
    sched.check_invariants()
    produced = sched.update(plan, runner.execute(plan))
    sched.check_invariants()
    return plan, produced


def drain(sched: Scheduler, runner: FakeRunner, limit=10_000) -> None:
    for _ in range(limit):
        if not sched.has_unfinished:
            return
        step(sched, runner)
    raise AssertionError("no progress")


def expected_tokens(rid: str, num_prompt: int, max_new: int, ignore_eos: bool, model_len: int) -> list[int]:
    out: list[int] = []
    while True:
        out.append(fake_token(rid, num_prompt + len(out)))
        if (out[-1] == EOS and not ignore_eos) or len(out) >= max_new or num_prompt + len(out) >= model_len:
            return out


def test_chunked_prefill_takes_four_steps_and_samples_on_the_last():
    sched, runner = make(tokens=32, block_size=16)
    r = request("a", 100)
    sched.add(r)
    chunks = []
    for _ in range(4):
        plan, produced = step(sched, runner)
        chunks.append(plan.num_scheduled_tokens["a"])
        assert produced == ([r] if len(chunks) == 4 else []) and r.num_generated_tokens == (len(chunks) == 4)
    assert chunks == [32, 32, 32, 4]
    assert r.num_computed_tokens == 100 and len(r.block_ids) == 7
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1} and plan.cached_requests[0].new_block_ids == []


def test_decodes_come_before_waiting_prompts():
    sched, runner = make(tokens=10)
    a = request("a", 5)
    sched.add(a)
    step(sched, runner)
    b, c = request("b", 30), request("c", 3)
    sched.add(b)
    sched.add(c)
    plan, produced = step(sched, runner)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]  # c waits behind b
    assert produced == [a] and [n.request_id for n in plan.new_requests] == ["b"]
    plan, _ = step(sched, runner)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]


def test_guesses_are_verified_for_decoding_requests_only_and_cut_to_their_room():
    sched, runner = make(tokens=10)
    a, b = request("a", 5, max_new=5), request("b", 30)
    sched.add(a)
    step(sched, runner)  # a decodes from now on
    sched.add(b)
    step(sched, runner)  # b is mid-prompt: a guess for it would follow a prompt chunk
    guesses = {"a": [7, 8, 9], "b": [4, 4], "gone": [1]}
    plan = sched.schedule(guesses)
    # a may emit 3 more tokens, its own among them: two guesses; b's are dropped; the proposer's dict is untouched
    assert plan.spec_token_ids == {"a": [7, 8]} and plan.num_scheduled_tokens == {"a": 3, "b": 7}
    assert guesses == {"a": [7, 8, 9], "b": [4, 4], "gone": [1]} and not b.spec_token_ids


def test_max_num_seqs_caps_running_requests():
    sched, runner = make(seqs=2)
    for i, max_new in enumerate([2, 5, 5]):
        sched.add(request(f"r{i}", 4, max_new=max_new))
    plan, _ = step(sched, runner)
    assert set(plan.num_scheduled_tokens) == {"r0", "r1"} and sched.num_waiting == 1
    plan, produced = step(sched, runner)
    assert [r.request_id for r in produced if r.is_finished] == ["r0"]
    plan, _ = step(sched, runner)
    assert plan.finished_ids == ["r0"] and plan.num_scheduled_tokens == {"r1": 1, "r2": 4}


def test_admission_is_first_come_first_served():
    sched, runner = make(num_blocks=6, block_size=4, caching=False)
    sched.add(request("a", 12, max_new=4))  # 3 blocks
    step(sched, runner)
    sched.add(request("big", 16))  # 4 blocks: does not fit in the 3 left
    sched.add(request("small", 2))  # would fit
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1} and sched.num_waiting == 2
    drain(sched, runner)
    assert sched.block_manager.num_free_blocks == 6


def test_preemption_of_the_newest_request_and_its_recomputation():
    sched, runner = make(num_blocks=4, block_size=4, caching=False)
    a, b = request("a", 7, max_new=8), request("b", 7, max_new=8)
    sched.add(a)
    sched.add(b)
    step(sched, runner)  # both prefill: 2 blocks each, the pool is full
    step(sched, runner)  # both decode into their second block (position 7)
    sched.add(request("c", 1))
    plan, _ = step(sched, runner)  # a needs a third block: b, the newest, goes
    assert plan.preempted_ids == ["b"] and plan.num_scheduled_tokens == {"a": 1} and plan.new_requests == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b back at the front
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    drain(sched, runner)
    for r in (a, b):
        assert r.output_token_ids == expected_tokens(r.request_id, 7, 8, True, 256)
    assert sched.block_manager.num_free_blocks == 4


def test_a_request_preempts_itself_when_it_is_the_newest():
    sched, runner = make(num_blocks=5, block_size=4, caching=False)
    a, b = request("a", 8, max_new=8), request("b", 7, max_new=8)
    sched.add(a)
    sched.add(b)
    step(sched, runner)  # 2 blocks each, one left
    step(sched, runner)  # a (position 8) takes the last free block
    plan, _ = step(sched, runner)  # b needs one: it is the newest itself
    assert plan.preempted_ids == ["b"] and plan.num_scheduled_tokens == {"a": 1}
    drain(sched, runner)
    assert b.output_token_ids == expected_tokens("b", 7, 8, True, 256)


def test_prefix_hit_is_scheduled_from_the_cached_position():
    sched, runner = make(block_size=4)
    prefix = list(range(2, 16))  # 3.5 blocks
    sched.add(request("a", prefix + [3], max_new=2))
    drain(sched, runner)
    b = request("b", prefix + [4, 5])
    sched.add(b)
    plan, _ = step(sched, runner)
    assert plan.new_requests[0].num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert plan.num_scheduled_tokens == {"b": 4}


def test_copies_of_a_prompt_arriving_together_share_its_blocks():
    """`n` choices (or a shared system prompt arriving at once): the first computes the prompt, the
    others wait for its blocks to reach the prefix cache instead of computing them again; a request
    behind them with another prompt is not held up."""
    sched, runner = make(block_size=4, tokens=64)
    prompt = list(range(2, 16))  # 14 tokens: 3 full blocks and a partial one
    copies = [request(f"c{i}", prompt, max_new=3, do_sample=True, seed=i) for i in range(3)]
    other = request("other", list(range(30, 39)))
    for r in copies + [other]:
        sched.add(r)
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"c0": 14, "other": 9}
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"c0": 1, "other": 1, "c1": 2, "c2": 2}  # 12 of 14 from the cache
    assert copies[1].num_cached_tokens == copies[2].num_cached_tokens == 12
    assert copies[1].block_ids[:3] == copies[2].block_ids[:3] == copies[0].block_ids[:3]
    drain(sched, runner)
    for r in copies:
        assert r.output_token_ids == expected_tokens(r.request_id, 14, 3, True, 256)


def test_without_prefix_caching_copies_run_at_once():
    sched, runner = make(block_size=4, caching=False)
    for i in range(2):
        sched.add(request(f"c{i}", list(range(2, 16)), max_new=2))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"c0": 14, "c1": 14}


def test_abort_frees_blocks_at_once():
    sched, runner = make(num_blocks=8)
    a, b = request("a", 10), request("b", 3)
    sched.add(a)
    step(sched, runner)
    sched.add(b)
    assert sched.abort("a") is a and a.finish_reason == FINISH_ABORT
    assert sched.block_manager.num_free_blocks == 8 and a.block_ids == []
    assert sched.abort("b") is b and sched.abort("b") is None and sched.abort("nope") is None
    assert not sched.has_unfinished
    plan = sched.schedule()
    assert plan.finished_ids == ["a"] and plan.num_scheduled_tokens == {}  # b never reached the runner


def test_abort_between_schedule_and_update_drops_the_result():
    sched, runner = make()
    a = request("a", 4)
    sched.add(a)
    plan = sched.schedule()
    sampled = runner.execute(plan)
    sched.abort("a")
    assert sched.update(plan, sampled) == [] and a.output_token_ids == []


def test_stops_at_eos_and_at_the_model_length():
    sched, runner = make(model_len=10)
    long = request("long", 8, max_new=50)
    sched.add(long)
    drain(sched, runner)
    assert long.num_tokens == 10 and long.finish_reason == FINISH_LENGTH
    rid = next(f"e{i}" for i in range(1000) if fake_token(f"e{i}", 4) == EOS)
    eos = Request(rid, [5, 6, 7, 8], SamplingParams(max_new_tokens=5), frozenset({EOS}), 0)
    sched.add(eos)
    drain(sched, runner)
    assert eos.output_token_ids == [EOS] and eos.finish_reason == FINISH_EOS


def test_add_rejects_what_could_never_run():
    sched, _ = make(num_blocks=4, block_size=4, model_len=32)
    with pytest.raises(ValueError):
        sched.add(request("too-long", 33))
    with pytest.raises(ValueError):
        sched.add(request("too-big", 10, max_new=10))  # 19 slots > 16
    sched.add(request("fits", 10, max_new=7))  # 16 slots
    with pytest.raises(ValueError):
        sched.add(request("fits", 3))
    assert sched.num_waiting == 1 and sched.requests["fits"].status is Status.WAITING


# -- randomized scenarios ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: list[int]
    max_new: int
    ignore_eos: bool
    arrival: int
    abort_at: int | None
    priority: int = 0


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    model_len = draw(st.sampled_from([12, 24, 48]))
    tokens = st.integers(2, VOCAB - 1)
    prefixes = [draw(st.lists(tokens, max_size=20)) for _ in range(2)]
    specs = []
    for i in range(draw(st.integers(1, 8))):
        prompt = (draw(st.sampled_from(prefixes)) + draw(st.lists(tokens, max_size=8)))[:model_len] or [2]
        specs.append(Spec(f"r{i}", prompt, draw(st.integers(1, 12)), draw(st.booleans()),
                          draw(st.integers(0, 8)), draw(st.none() | st.integers(0, 30)), draw(st.integers(0, 2))))
    limits = {"block_size": block_size, "model_len": model_len, "caching": draw(st.booleans()),
              "seqs": draw(st.integers(1, 6)), "tokens": draw(st.integers(1, 40))}
    extra_blocks = draw(st.integers(0, 3))  # few: preemptions
    # speculation (k guesses per decode, a third wrong: rollback), multi-step (steps > 1), async
    # scheduling (plan k + 1 made before update(k)), or none
    speed = draw(st.sampled_from([(0, 1, False), (1, 1, False), (3, 1, False), (5, 1, False), (0, 2, False),
                                  (0, 4, False), (0, 8, False), (0, 1, True)]))
    # queue order: first come first served, by priority (preempting lower ones), tenants' fair shares
    limits["policy"] = draw(st.sampled_from(["fcfs", "priority", "fair", "priority+fair"]))
    return specs, limits, extra_blocks, speed


def run_scenario(specs: list[Spec], limits: dict, num_blocks: int, k: int = 0, steps: int = 1,
                 pipelined: bool = False) -> tuple[dict[str, Request], Scheduler]:
    limits = dict(limits)
    policy = limits.pop("policy", "fcfs")
    slo = ServiceLevel(policy.split("+")[0] if policy != "fair" else "fcfs",
                       fair_share=FairShare() if "fair" in policy else None)
    sched, runner = make(num_blocks=num_blocks, steps=steps, slo=slo, **limits)
    reqs: dict[str, Request] = {}
    in_flight = None  # async scheduling: (plan, its results) not yet applied
    for n in range(5_000):
        for spec in specs:
            if spec.arrival == n:
                reqs[spec.request_id] = Request(spec.request_id, spec.prompt, SamplingParams(
                    max_new_tokens=spec.max_new, ignore_eos=spec.ignore_eos), frozenset({EOS}), n,
                    priority=spec.priority, tenant=f"t{spec.priority}")
                sched.add(reqs[spec.request_id])
            if spec.abort_at == n:
                sched.abort(spec.request_id)
        if not sched.has_unfinished and n > max(s.arrival for s in specs):
            break
        if pipelined:  # the runner runs plans in order; update(k) comes after schedule(k + 1)
            plan = sched.schedule()
            sched.check_invariants()
            results = runner.execute(plan)
            if in_flight is not None:
                sched.update(*in_flight)
                sched.check_invariants()
            in_flight = None if not sched.has_unfinished else (plan, results)
            if in_flight is None:
                sched.update(plan, results)
        else:
            plan, _ = step(sched, runner, k)
            assert plan.total_num_scheduled_tokens > 0 or not sched.has_unfinished
        assert sched.num_running <= sched.max_num_seqs
    else:
        raise AssertionError("the scenario did not finish")
    assert sched.block_manager.num_free_blocks == num_blocks and not sched.running and not sched.waiting
    sched.block_manager.check_invariants([])
    return reqs, sched


def needed_blocks(spec: Spec, block_size: int, model_len: int) -> int:
    num_final = min(len(spec.prompt) + spec.max_new, model_len)
    return -(-max(len(spec.prompt), num_final - 1) // block_size)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_scenarios_keep_budgets_blocks_and_tokens(scenario):
    specs, limits, extra_blocks, (k, steps, pipelined) = scenario
    bs, model_len = limits["block_size"], limits["model_len"]
    small = max(needed_blocks(s, bs, model_len) for s in specs) + extra_blocks
    huge = sum(needed_blocks(s, bs, model_len) for s in specs) + 1
    (got, sched), (reference, _) = run_scenario(specs, limits, small, k, steps, pipelined), \
        run_scenario(specs, limits, huge)
    event(f"speculating {k}, steps {steps}, async {pipelined}")
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"policy {limits['policy']}, preempted for priority: {sched.slo.num_priority_preemptions > 0}")
    event(f"prefix hit: {sched.block_manager.num_prefix_hit_tokens > 0}")
    event(f"aborted: {any(r.finish_reason == FINISH_ABORT for r in got.values())}")
    event(f"chunked: {any(len(s.prompt) > limits['tokens'] for s in specs)}")
    for spec in specs:
        want = expected_tokens(spec.request_id, len(spec.prompt), spec.max_new, spec.ignore_eos, model_len)
        for reqs in (got, reference):
            r = reqs[spec.request_id]
            assert r.is_finished and r.block_ids == []
            if r.finish_reason == FINISH_ABORT:
                assert r.output_token_ids == want[:r.num_generated_tokens]
            else:
                assert r.output_token_ids == want
        if FINISH_ABORT not in (got[spec.request_id].finish_reason, reference[spec.request_id].finish_reason):
            assert got[spec.request_id].output_token_ids == reference[spec.request_id].output_token_ids


def test_lora_slots_go_to_a_free_slot_then_to_the_least_recently_used_idle_adapter():
    from collections import Counter

    from engines.core.lora_slots import LoraSlots

    slots = LoraSlots(2)
    assert slots.acquire("a") == (1, True) and slots.acquire("b") == (2, True)
    assert slots.acquire("a") == (1, False)  # resident: nothing to load
    assert not slots.can_acquire("c")  # both held
    slots.release("b")
    slots.release("a")
    slots.release("a")  # a released last: b is the least recently used
    assert slots.acquire("c") == (2, True) and "b" not in slots.slot_of
    slots.check_invariants(Counter({"c": 1}))
    assert slots.pin("a") == (1, False)
    assert not slots.can_acquire("d")  # a pinned, c held
    slots.release("c")
    assert slots.forget("a") == 1 and slots.acquire("d") == (1, True)
    slots.check_invariants(Counter({"d": 1}))
    with pytest.raises(AssertionError, match="released more often"):
        slots.release("c")


def test_a_request_whose_adapter_has_no_slot_waits_while_those_behind_it_go_on():
    """One LoRA slot: A's requests run together (A loaded once), B's waits until the last of them ends,
    the base model's never waits; a preempted request gives its slot back."""
    from engines.core.lora_slots import LoraSlots
    from engines.core.plan import LoraLoad

    bm = BlockManager(64, 4, True)
    sched, runner = Scheduler(8, 64, bm, 256, 1, LoraSlots(1)), FakeRunner(bm)
    reqs = [request("a1", 5, max_new=3), request("b1", 5, max_new=3), request("base", 5, max_new=3),
            request("a2", [50 + i for i in range(6)], max_new=5)]  # (no prefix shared with a1)
    for r, name in zip(reqs, ["A", "B", None, "A"]):
        r.lora_name = name
        sched.add(r)
    plan, _ = step(sched, runner)
    assert plan.lora_loads == [LoraLoad(1, "A")] and set(plan.num_scheduled_tokens) == {"a1", "base", "a2"}
    assert [r.request_id for r in sched.waiting] == ["b1"]
    while "b1" not in plan.num_scheduled_tokens:
        plan, _ = step(sched, runner)
        assert not plan.lora_loads or "b1" in plan.num_scheduled_tokens
    assert plan.lora_loads == [LoraLoad(1, "B")] and reqs[3].is_finished  # B's turn after A's last request
    drain(sched, runner)
    assert reqs[1].output_token_ids == expected_tokens("b1", 5, 3, True, 256)
    assert sched.lora_slots.slot_of == {"B": 1} and not sched.lora_slots.num_holders
