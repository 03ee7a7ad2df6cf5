"""Token-budget scheduler of the paged engine (pure Python: no torch).

Each step hands the model runner a plan (StepPlan, engines/core/plan.py): how many tokens of which requests to
compute, under `max_num_batched_tokens` tokens and `max_num_seqs` running requests. A prefill and
a decode are the same thing here: a request computes `num_tokens - num_computed_tokens` tokens,
chunked to what the budget leaves (1 for a decoding request).

    schedule()  running first, in admission order; if blocks run out, preempt the newest running
                request (free its blocks, recompute it later) and retry; then, unless this step
                preempted, admit waiting requests first come first served, with their prefix hit
    runner      computes the scheduled tokens, samples one token for each request whose chunk
                reached the end of its tokens
    update()    advances num_computed_tokens, appends the sampled tokens, retires finished requests

Speculative decoding: a decoding request with proposed tokens (`schedule(proposals)`: the
engine's proposer guesses them from the requests' tokens) computes 1 + k tokens; the runner verifies them and returns the
accepted ones plus one; update() keeps the K/V of the verified tokens only and trims the blocks
that held rejected ones (they were never registered in the prefix cache: only blocks full of
verified tokens are).

Async scheduling: the engine may schedule plan k + 1 while plan k runs, before update(k). Each
request remembers what the last plan that scheduled it will add (`in_flight`: tokens computed,
tokens emitted); scheduling counts those as done, with placeholders for the tokens not known yet
(the runner, which appends its own sampled tokens, has them by the time it runs plan k + 1). A
request whose plan in flight emits its last token is not scheduled again; one that stops early
(a stop token) wastes the step after, whose results update() drops.

Multi-step (num_scheduler_steps n > 1): when every running request is decoding and none waits, one
plan runs up to n decode steps back to back (num_steps), with each request's slots for them
allocated up front; update() cuts the tokens past a stop.

LoRA adapters (lora_slots): a request is admitted with its adapter's device slot held until it
leaves the running batch; one whose adapter cannot get a slot (all held by other adapters' running
requests) waits while those behind it go on; the plan names the adapters to load first.

Service levels (engines/core/slo.py, ServiceLevel): the queue's order (arrival, priority, fair-share tags),
who is preempted first (under priority `running` is kept in priority order), the TPOT pacer's caps, and
deadlines (Shed raised by add(); take_expired() for those still waiting when theirs comes).

The plan (engines/core/plan.py) says only what changed: requests new to the runner (or back after
a preemption) in full, others as the block ids appended since the last plan.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping

from engines.core.block_manager import BlockManager
from engines.core.lora_slots import LoraSlots
from engines.core.plan import CachedRequest, LoraLoad, NewRequest, StepPlan
from engines.core.request import InFlight, PrefixProbe, Request, Status
from engines.core.slo import ServiceLevel, Shed
from engines.protocol import FINISH_LENGTH


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 max_model_len: int, num_scheduler_steps: int = 1, lora_slots: LoraSlots | None = None,
                 service_level: ServiceLevel | None = None):
        if min(max_num_seqs, max_num_batched_tokens, max_model_len, num_scheduler_steps) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, max_model_len and num_scheduler_steps "
                             "must be positive")
        self.num_scheduler_steps = num_scheduler_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.lora_slots = lora_slots  # option.enable_lora: which adapter holds which device slot
        self.max_model_len = max_model_len
        # queue order, priority preemption, pacing to a TPOT target, deadlines (engines/core/slo.py)
        self.slo = service_level or ServiceLevel()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self._num_blocks_sent: dict[str, int] = {}  # requests the runner holds -> len(block_ids) it knows
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self._num_plans = 0
        self._last_shape: tuple[int, int, int, int] | None = None  # the last plan: tokens, requests, context, steps

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, req: Request) -> None:
        """Queue a request; ValueError when it could never run (too long for the model or the cache)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not 0 < req.num_prompt_tokens <= self.max_model_len or req.sampling.max_new_tokens < 1:
            raise ValueError(f"{req.request_id}: prompt of {req.num_prompt_tokens} tokens, "
                             f"max_new_tokens {req.sampling.max_new_tokens}, max_model_len {self.max_model_len}")
        if self.block_manager.num_blocks_for(self.max_num_slots(req)) > self.block_manager.num_blocks:
            raise ValueError(f"{req.request_id}: needs more KV blocks than the cache has")
        req.status = Status.WAITING
        self.slo.arrived(req)
        self.slo.enqueue(self.waiting, req)
        self.requests[req.request_id] = req
        if req.deadline is not None:
            try:  # Shed: expected to start after its deadline, answered now
                self.slo.shed_if_late(req, self.running, self.waiting, self.max_num_seqs, self.max_num_batched_tokens)
            except Shed:
                del self.requests[req.request_id]
                raise

    def take_expired(self) -> list[Request]:
        """Waiting requests that can no longer start before their deadline, taken out of the queue."""
        expired = self.slo.take_expired(self.waiting)
        for req in expired:
            del self.requests[req.request_id]
        return expired

    def max_num_slots(self, req: Request) -> int:
        """KV slots the request holds at its longest: the last sampled token is never computed."""
        num_final = min(req.max_num_tokens, self.max_model_len)
        return max(req.num_prompt_tokens, num_final - 1)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            self.slo.left(req)
        else:
            self.running.remove(req)
        req.abort()
        self._retire(req)
        return req

    def can_speculate(self, req: Request) -> bool:
        """A running request with one token to compute (decoding), no plan in flight and no penalties."""
        return (req.status is Status.RUNNING and req.num_tokens - req.num_computed_tokens == 1
                and req.in_flight is None and req.can_speculate)

    def spec_room(self, req: Request) -> int:
        """How many proposed tokens the request can verify: it may still emit them and one more."""
        return max(0, min(req.num_remaining_tokens, self.max_model_len - req.num_tokens) - 1)

    def schedule(self, proposals: Mapping[str, list[int]] | None = None) -> StepPlan:
        """The next step's plan. `proposals`: request id → tokens guessed for it (speculative
        decoding), verified when it is scheduled as a decode; cut to what it may still emit."""
        self._num_plans += 1
        out = StepPlan(plan_id=self._num_plans, finished_ids=self._finished_ids)
        self._finished_ids = []
        for req in self.running:  # guesses follow a decoding request's last token only
            guess = proposals.get(req.request_id) if proposals else None
            req.spec_token_ids = list(guess) if guess and self.can_speculate(req) else []
        if not (self.num_scheduler_steps > 1 and self._schedule_multi_step(out)):
            self._schedule_tokens(out)
        requests = self.requests
        self._last_shape = (out.total_num_scheduled_tokens // out.num_steps, len(out.scheduled),
                            sum(requests[rid].num_tokens for rid in out.scheduled_ids), out.num_steps)
        return out

    def observe_step(self, seconds: float) -> None:
        """The wall time of the step that ran the last plan: the step-time model learns from it."""
        if self._last_shape is not None:
            num_tokens, num_seqs, num_context, num_steps = self._last_shape
            self.slo.step_times.observe(num_tokens, num_seqs, num_context, seconds / num_steps)
            self._last_shape = None

    def _schedule_tokens(self, out: StepPlan) -> None:
        if self.slo.by_priority and self.waiting and self.running:
            self._preempt_for_priority(out)
        num_preempted = len(out.preempted_ids)
        budget = self._schedule_running(out)
        if len(out.preempted_ids) == num_preempted:  # (blocks ran out: nobody joins this step)
            self._schedule_waiting(out, budget)

    def _preempt_for_priority(self, out: StepPlan) -> None:
        """The first waiting request preempts running ones of lower priority, the lowest (then the
        newest) first, until the batch has a row, the pacer room and the blocks for its first chunk."""
        head, bm, pacer = self.waiting[0], self.block_manager, self.slo.pacer
        while self.running and self.running[-1].priority > head.priority:
            need = bm.num_blocks_for(min(head.num_tokens, self.max_num_batched_tokens)) + len(self.running)
            fits = pacer is None or pacer.can_add(len(self.running), sum(r.num_tokens for r in self.running))
            if len(self.running) < self.max_num_seqs and bm.num_free_blocks >= need and fits:
                return
            self._preempt(self.running.pop(), out)
            self.slo.num_priority_preemptions += 1

    def update(self, output: StepPlan, sampled: Mapping[str, list[int]]) -> list[Request]:
        """Apply a step's results (sampled: request id -> its new tokens); return the requests that
        got tokens, each with the ones kept (cut after a stop) as its last output tokens."""
        produced: list[Request] = []
        bm = self.block_manager
        for seq in output.scheduled:
            request_id, num_tokens = seq.request_id, seq.num_tokens
            req = self.requests.get(request_id)
            if req is None:
                continue  # aborted or finished since the plan was made
            if req.status is Status.WAITING:
                # preempted by the plan made after this one (async scheduling): the tokens this one
                # sampled stand (a seeded request draws each token once), its K/V are recomputed
                if request_id in sampled:
                    self._append(req, sampled[request_id])
                    if req.is_finished:
                        self.waiting.remove(req)
                        self.slo.left(req)
                    produced.append(req)
                continue
            if req.in_flight is not None and req.in_flight.plan_id == output.plan_id:
                req.in_flight = None
            req.spec_token_ids = []
            if req.num_computed_tokens + num_tokens < req.num_tokens:
                req.num_computed_tokens += num_tokens  # mid-prefill: its logits are not wanted
                bm.cache_full_blocks(req, req.num_computed_tokens)
                bm.release_outside_window(req)
                continue
            self._append(req, sampled[request_id])
            # K/V hold every token but the last sampled: speculated positions past it are dropped
            req.num_computed_tokens = req.num_tokens - 1
            bm.cache_full_blocks(req, req.num_computed_tokens)
            bm.release_outside_window(req)
            if seq.spec_token_ids and not req.is_finished:
                bm.trim(req, req.num_tokens)
                self._num_blocks_sent[request_id] = min(self._num_blocks_sent[request_id], len(req.block_ids))
            produced.append(req)
        finished = [r for r in produced if r.is_finished]
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            for req in finished:
                self._retire(req)
        return produced

    def _append(self, req: Request, tokens: list[int]) -> None:
        for token in tokens:
            req.append_token(token)
            if not req.is_finished and req.num_tokens >= self.max_model_len:
                req.finish(FINISH_LENGTH)
            if req.is_finished:
                return  # tokens past a stop (multi-step, speculation) are cut

    def check_invariants(self) -> None:
        """Raise AssertionError unless queues, budgets and blocks agree (for tests)."""
        bm = self.block_manager
        bm.check_invariants(self.running)
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs {self.max_num_seqs}")
        waiting_ids = {r.request_id for r in self.waiting}
        running_ids = {r.request_id for r in self.running}
        if waiting_ids & running_ids or waiting_ids | running_ids != set(self.requests):
            raise AssertionError("waiting, running and the request map disagree")
        if any(r.block_ids or r.num_computed_tokens for r in self.waiting):
            raise AssertionError("a waiting request holds blocks")
        if self.lora_slots is not None:
            self.lora_slots.check_invariants(Counter(r.lora_name for r in self.running if r.lora_name is not None))
            if any(r.holds_lora_slot for r in self.waiting):
                raise AssertionError("a waiting request holds a LoRA slot")
        for req in self.running:
            if len(req.block_ids) * bm.block_size < req.num_computed_tokens:
                raise AssertionError(f"{req.request_id}: computed tokens outside its blocks")
            if bm.num_blocks_for(self.max_num_slots(req)) < len(req.block_ids):
                raise AssertionError(f"{req.request_id}: holds more blocks than it can ever fill")

    def _schedule_multi_step(self, out: StepPlan) -> bool:
        """Every running request decodes up to num_scheduler_steps tokens in one plan, when none waits
        (a prefill or an arrival goes back to single steps, so that it does not wait for the run),
        none speculates and the blocks for all of them are free. False: schedule as usual."""
        running, bm = self.running, self.block_manager
        if self.waiting or not running or any(r.num_tokens - r.num_computed_tokens != 1 or r.spec_token_ids
                                               or r.in_flight for r in running):
            return False  # (the engine does not pipeline multi-step plans: nothing is in flight)
        # no request may go past its max_new_tokens or the model length: no slot beyond what it can hold
        n = min([self.num_scheduler_steps] + [min(r.num_remaining_tokens, self.max_model_len - r.num_tokens)
                                              for r in running])
        if n < 2 or sum(bm.num_new_blocks(r, n) for r in running) > bm.num_free_blocks:
            return False
        out.num_steps = n
        for req in running:
            if not bm.allocate(req, n):
                raise AssertionError(f"{req.request_id}: the blocks counted free were not")
            self._record(req, n, out)
        return True

    def _schedule_running(self, out: StepPlan) -> int:
        budget = self.max_num_batched_tokens
        if self.slo.pacer is not None:  # option.target_tpot_ms: a step no longer than the target
            budget = self.slo.pacer.token_budget(len(self.running), sum(r.num_tokens for r in self.running), budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending, emitting = _in_flight_counts(req)
            if emitting and (emitting >= req.num_remaining_tokens or req.num_tokens + emitting >= self.max_model_len):
                i += 1  # its plan in flight emits its last token
                continue
            num_uncomputed = req.num_tokens + emitting - req.num_computed_tokens - pending
            # proposed tokens (a decoding request only) within what it may emit and the budget
            req.spec_token_ids = req.spec_token_ids[:max(0, min(self.spec_room(req), budget - num_uncomputed))]
            num_new = min(num_uncomputed + len(req.spec_token_ids), budget)
            while not self.block_manager.allocate(req, pending + num_new):
                if req.spec_token_ids:  # speculation gives way before anyone is preempted
                    num_new -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._record(req, num_new, out)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: StepPlan, budget: int) -> None:
        """First come first served, with one exception: a request whose next uncached block is the
        one a running request is computing right now (the same prompt: `n` copies, or a shared
        system prompt arriving together) waits a step or so and takes it from the prefix cache,
        instead of computing and storing it again; requests behind it go on."""
        bm = self.block_manager
        computing = {r.prefix_probe.hash for r in self.running
                     if r.prefix_probe and r.num_computed_tokens + _in_flight_counts(r)[0] < r.prefix_probe.end}
        pacer = self.slo.pacer
        preempted = set(out.preempted_ids)
        context = sum(r.num_tokens for r in self.running) if pacer is not None else 0
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs and budget > 0:
            if pacer is not None and not pacer.can_add(len(self.running), context):
                break  # one more decoding request would take the step past option.target_tpot_ms
            req = self.waiting[i]
            if req.request_id in preempted:
                i += 1  # (preempted for a higher priority this step: its plan in flight is still to apply)
                continue
            computed, probe = bm.lookup(req)
            if probe is not None and probe in computing or \
                    req.lora_name is not None and not self.lora_slots.can_acquire(req.lora_name):
                i += 1  # (every LoRA slot is held by running requests of other adapters)
                continue
            step_budget = budget - (pacer.seq_tokens() if pacer is not None and self.running else 0)  # (its row)
            if step_budget <= 0:
                break
            num_new = min(req.num_tokens - len(computed) * bm.block_size, step_budget)
            if not bm.allocate(req, num_new, computed):
                break  # nobody else jumps the queue for lack of blocks
            del self.waiting[i]
            req.status = Status.RUNNING
            req.prefix_probe = None if probe is None else PrefixProbe(probe, (len(computed) + 1) * bm.block_size)
            if probe is not None:
                computing.add(probe)
            self.slo.admit(self.running, req)
            context += req.num_tokens
            load = self.lora_slots.hold(req) if self.lora_slots is not None else None
            if load is not None:
                out.lora_loads.append(LoraLoad(load, req.lora_name))
            self._record(req, num_new, out)
            budget = step_budget - num_new

    def _record(self, req: Request, num_tokens: int, out: StepPlan) -> None:
        num_sent = self._num_blocks_sent.get(req.request_id)
        pending, emitting = _in_flight_counts(req)
        computed = req.num_computed_tokens + pending
        if num_sent is None:
            out.new_requests.append(NewRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens,
                                               list(req.block_ids), req.num_computed_tokens, req.sampling,
                                               req.lora_name))
        else:
            out.cached_requests.append(CachedRequest(req.request_id, req.block_ids[num_sent:], computed, num_sent))
        reaches_end = computed + num_tokens >= req.num_tokens + emitting
        req.in_flight = InFlight(out.plan_id, num_tokens, out.num_steps if out.num_steps > 1 else int(reaches_end))
        self._num_blocks_sent[req.request_id] = len(req.block_ids)
        out.add(req.request_id, num_tokens, list(req.spec_token_ids))

    def _preempt(self, req: Request, out: StepPlan) -> None:
        self._release_lora_slot(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.in_flight = None
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.slo.enqueue(self.waiting, req, preempted=True)
        self.num_preemptions += 1
        if self._num_blocks_sent.pop(req.request_id, None) is not None:
            out.preempted_ids.append(req.request_id)

    def _retire(self, req: Request) -> None:
        """A finished or aborted request: free its blocks, tell the runner to drop it."""
        self._release_lora_slot(req)
        self.block_manager.free(req)
        self.requests.pop(req.request_id, None)
        if self._num_blocks_sent.pop(req.request_id, None) is not None:
            self._finished_ids.append(req.request_id)

    def _release_lora_slot(self, req: Request) -> None:
        if self.lora_slots is not None:
            self.lora_slots.let_go(req)


def _in_flight_counts(req: Request) -> tuple[int, int]:
    """(tokens computed, tokens emitted) by the request's plan in flight: counted as done."""
    return (req.in_flight.num_computed, req.in_flight.num_emitted) if req.in_flight else (0, 0)
