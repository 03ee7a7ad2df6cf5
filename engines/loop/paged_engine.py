"""Rolling batching over a paged KV cache: the step is schedule → execute → sample → update → publish.

The KV cache is sized from the memory budget left after loading the weights; the block manager
and the token-budget scheduler (engines/core, pure Python) decide what each step computes; the
scheduling mode (engines/core/modes.py) picks the step loop (steppers.py) once.
"""

from __future__ import annotations

import logging
import math
import time

import msgspec

from engines.spec import ModelSpec
from engines.attention.registry import select_backend
from engines.config import LmiConfig, runner_model
from engines.core.block_manager import BlockManager
from engines.core.lora_slots import LoraSlots
from engines.core.modes import scheduling_mode
from engines.core.plan import StepPlan
from engines.core.request import Request
from engines.core.scheduler import Scheduler
from engines.core.forecast import Forecast, Screen
from engines.core.slo import Shed, service_level
from engines.core.spec import NgramProposer
from engines.process.startup import TIMELINE
from engines.protocol import FINISH_ERROR, STATE_READY, Add, HealthReply, Output
from engines.dist import SingleProcess
from engines.loop.engine_loop import EngineLoop, kv_budget_bytes
from engines.loop.lora_registry import LoraRegistry
from engines.loop.tier_loads import TierLoads, tier_settings
from engines.worker.mirror import Allocate, Execute, Flush, Mirrored, WarmUp, WarmUpBuckets
from engines.worker.model_runner import ModelRunner
from engines.worker.paged_runner import DECODE_EAGER, DECODE_GRAPHS, DECODE_INDUCTOR, PagedRunner
from engines.worker.sampler import PromptLogprobs
from engines.worker.step_output import StepResult
from engines.loop.steppers import PipelinedStepper, SpeculativeStepper, SyncStepper
from engines.weights.memory_plan import available_ram

log = logging.getLogger(__name__)


class PagedEngine(EngineLoop):
    def __init__(self, config: LmiConfig, publish, comm=None):
        super().__init__(config, publish, comm or SingleProcess())
        self.runner = ModelRunner(runner_model(config), ModelSpec.of(config.model), self.comm)
        self.max_model_len = self.runner.max_model_len
        self.mode = scheduling_mode(config.scheduler)  # ValueError: the launcher refused it already
        self._prompt = PromptLogprobBuffer()
        self._arrivals = 0
        self.proposer = None  # speculative decoding (engines/core/spec.py, engines/loop/draft.py)
        self.spec = SpecStats()
        self.num_multi_steps = 0  # plans that ran more than one decode step
        self.stepper = None
        self.tier_loads: TierLoads | None = None  # option.kv_offload_*: the KV tiers below the pool
        self._busy_since: float | None = None  # when the last step began, if the loop has been busy since
        # deadlines shed at arrival by the IO thread (engines/core/forecast.py; not with fair shares,
        # whose order the IO thread cannot know): the loop's latest forecast, the requests taken so far
        self._screen: Screen | None = None
        self._forecast: Forecast | None = None
        self._forecasting = config.scheduler.max_queue_wait_ms is not None
        self.num_shed_on_arrival = 0

    def load(self) -> None:
        self.runner.load()
        sched = self.config.scheduler
        block_size = self._block_size()
        block_bytes = block_size * self.runner.kv_bytes_per_token
        self.paged = Mirrored(PagedRunner(self.runner), self.comm)
        with TIMELINE.phase("warm_up"):
            peak = self.paged.call(WarmUp(min(sched.max_num_batched_tokens, self.max_model_len)))
        budget = kv_budget_bytes(sched, self.runner, self.comm.world_size, peak, block_size)
        num_blocks = max(budget // block_bytes, 1)
        decode_mode, why = self._decode_mode()
        tiers = tier_settings(sched, self.comm.world_size * self.config.parallel.copies, available_ram())
        with TIMELINE.phase("kv_allocation"):
            self.paged.call(Allocate(num_blocks, block_size, sched.max_num_seqs, sched.max_num_batched_tokens,
                                     sched.attention_backend, decode_mode, sched.compile_cache_dir,
                                     self.mode.step_kind, tiers))
        with TIMELINE.phase("warm_up_buckets" if decode_mode == DECODE_EAGER else f"warm_up_buckets_{decode_mode}"):
            self.paged.call(WarmUpBuckets())
        log.info("decode steps: %s (%s)", decode_mode, why)
        windows = [opts.window for opts in self.runner.layer_options]  # as the backends apply them
        # every layer sliding: blocks behind the widest window go back to the pool as requests decode
        self.blocks = BlockManager(num_blocks, block_size, sched.enable_prefix_caching,
                                   max(windows) if windows and all(windows) else None)
        lora_slots = LoraSlots(self.config.model.max_loras) if self.runner.lora is not None else None
        self.scheduler = Scheduler(sched.max_num_seqs, sched.max_num_batched_tokens, self.blocks, self.max_model_len,
                                   sched.num_scheduler_steps, lora_slots, service_level(sched, block_size))
        self.adapters = LoraRegistry(self.paged, lora_slots, self.reply) if lora_slots is not None else None
        self._screen = Screen() if not sched.fair_share_key else None
        if tiers is not None:
            self.tier_loads = TierLoads(self.blocks, self.paged)
            log.info("KV tiers (per rank, write-through): %s", self.paged.tiers.describe())
        self.paged.target.interrupted = self._arrived  # rank 0 ends a multi-step decode for an arrival
        self.proposer = self._make_proposer(block_size)
        self.stepper = SpeculativeStepper(self, self.proposer) if self.proposer else \
            PipelinedStepper(self) if self.mode.pipelined else SyncStepper(self)
        log.info("scheduling: %s (%s)", self.mode.name, self.mode.why)
        log.info("paged KV cache: %d blocks of %d tokens = %d tokens, %d bytes; attention backend %s; "
                 "prefix caching %s; max_num_seqs %d, max_num_batched_tokens %d", num_blocks, block_size,
                 num_blocks * block_size, num_blocks * block_bytes, self.paged.backend.name,
                 "on" if sched.enable_prefix_caching else "off", sched.max_num_seqs, sched.max_num_batched_tokens)

    def _make_proposer(self, block_size: int):
        sched = self.config.scheduler
        k = sched.num_speculative_tokens
        if self.mode.speculative_method == "ngram":
            log.info("speculative decoding: n-gram prompt lookup (%d to %d tokens), %d tokens proposed per step",
                     sched.ngram_prompt_lookup_min, sched.ngram_prompt_lookup_max, k)
            return NgramProposer(k, sched.ngram_prompt_lookup_min, sched.ngram_prompt_lookup_max)
        if self.mode.speculative_method == "draft":
            from engines.loop.draft import DraftProposer

            draft = msgspec.structs.replace(self.config.model, local_dir=sched.speculative_model, model_id=None,
                                            load_cache_dir=None)
            with TIMELINE.phase("draft_model"):
                return DraftProposer(draft, k, self.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens,
                                     block_size, sched.attention_backend, self.runner.model.lm_head.vocab_size)
        return None

    def _arrived(self) -> bool:
        return not self.inbox.empty()

    def _decode_mode(self) -> tuple[str, str]:
        """How decode steps run, and why (one log line)."""
        sched = self.config.scheduler
        if sched.enforce_eager:
            return DECODE_EAGER, "option.enforce_eager=true"
        if not self.runner.is_native:
            return DECODE_EAGER, "the transformers fallback runs eagerly"
        if self.runner.device.type == "cuda":
            if self.comm.world_size > 1:  # the collectives inside the step are not captured
                return DECODE_EAGER, "CUDA graphs are captured at tensor_parallel_degree=1 only"
            return DECODE_GRAPHS, "CUDA: one graph per decode batch bucket"
        if sched.cpu_compile:
            return DECODE_INDUCTOR, "option.cpu_compile=true: torch.compile (inductor)" + (
                f", cache in {sched.compile_cache_dir}" if sched.compile_cache_dir else "")
        return DECODE_EAGER, "CPU: torch.compile measured no faster here; option.cpu_compile=true turns it on"

    def _block_size(self) -> int:
        """option.kv_block_size, unless the attention backend needs another (flash-attn: 256)."""
        size = self.config.scheduler.kv_block_size
        backend = select_backend(self.config.scheduler.attention_backend, self.runner.device, self.runner.kv_dtype,
                                 self.runner.dtype)
        need = backend.preferred_block_size
        if need and size % need:
            log.info("attention backend %s needs KV blocks of a multiple of %d tokens: using %d, not "
                     "option.kv_block_size=%d", backend.name, need, need, size)
            return need
        return size

    def measure(self) -> HealthReply:
        used = self.blocks.num_blocks - self.blocks.num_free_blocks
        return HealthReply(STATE_READY, num_waiting=self.num_waiting, num_running=self.scheduler.num_running,
                           num_batches=self.num_steps, num_kv_slots=used * self.blocks.block_size,
                           metrics=self.metrics(),
                           adapters=self.adapters.infos(self.scheduler.requests) if self.adapters else [])

    def metrics(self) -> dict[str, float]:
        bm, sched = self.blocks, self.scheduler
        running = list(sched.running)
        held = {r.request_id: len(r.block_ids) - r.num_released_blocks for r in running}
        allocated = sum(held.values()) * bm.block_size
        # a request's tokens fill its slots (the newest is written next step): the rest of its
        # last block is what paging wastes (blocks released behind a sliding window hold none)
        stored = sum(min(r.num_tokens - r.num_released_blocks * bm.block_size, held[r.request_id] * bm.block_size)
                     for r in running)
        return {"kv_cache_usage": bm.usage, "kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks,
                "kv_slots_allocated": allocated, "kv_slots_unused": allocated - stored,
                "prefix_cache_hit_rate": bm.prefix_hit_rate, "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens,
                "prefix_cache_query_tokens": bm.num_prefix_queries_tokens,
                "preemptions": sched.num_preemptions, "running": sched.num_running,
                "waiting": sched.num_waiting, "steps": self.num_steps, "multi_step_runs": self.num_multi_steps,
                **self.spec.metrics(), **self.paged.sampler.grammars.metrics(),
                **sched.slo.metrics(sched.waiting, running, self.num_shed_on_arrival),
                **(self.tier_loads.metrics(bm.num_prefix_queries_tokens) if self.tier_loads else {})}

    def stop_ranks(self) -> None:
        if self.stepper is not None:
            self.stepper.drain()
        self.paged.target.close()
        self.paged.stop()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    def add(self, msg: Add) -> None:
        if self.refuses_adapter(msg) or self.refuses_grammar(msg, self.paged.sampler.grammars):
            return
        sched, slo, wait_ms = self.config.scheduler, msg.slo, self._max_wait_ms(msg)
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling, self.runner.eos_token_ids, self._arrivals,
                      msg.lora_name, priority=slo.priority,
                      tenant=msg.lora_name or "" if sched.fair_share_key == "adapter" else slo.tenant,
                      deadline=time.monotonic() + wait_ms / 1000 if wait_ms is not None else None)
        self._arrivals += 1
        try:
            self.scheduler.add(req)
        except Shed as exc:
            self.publish_shed(req.request_id, str(exc), exc.retry_after_s)
        except ValueError as exc:  # can never fit the cache (or the model): refuse now, not never
            self.publish_error(req.request_id, 507, f"the request cannot be served: {exc}")

    def _max_wait_ms(self, msg: Add) -> float | None:
        waits = [ms for ms in (msg.slo.max_wait_ms, self.config.scheduler.max_queue_wait_ms) if ms is not None]
        return min(waits) if waits else None

    def submit(self, msg) -> None:
        """(The IO thread.) A request that the latest forecast says cannot get its first token in time
        is answered 503 here and now, not after the step in progress; the rest go to the inbox."""
        if isinstance(msg, Add) and self._screen is not None and self._shed_on_arrival(msg):
            return
        super().submit(msg)

    def _shed_on_arrival(self, msg: Add) -> bool:
        f, wait_ms, sched = self._forecast, self._max_wait_ms(msg), self.config.scheduler
        budget = sched.max_num_batched_tokens
        prompt = len(msg.prompt_token_ids)
        steps = -(-prompt // budget) - 1 + msg.sampling.max_new_tokens
        key = (msg.slo.priority if self.scheduler.slo.by_priority else 0, math.inf, math.inf)  # behind its equals
        if wait_ms is not None:
            self._forecasting = True  # (from now on the loop keeps a forecast after each step)
            if f is not None:
                start, first = self._screen.first_token_s(f, key, prompt)
                if first > wait_ms / 1000:
                    self.num_shed_on_arrival += 1
                    self.publish_shed(msg.request_id, f"its first token would come in about {first:.2f} s, after its "
                                      f"deadline ({wait_ms / 1000:.2f} s from now)", start)
                    return True
        self._screen.let_through(key, steps, prompt, queued=f is not None)
        return False

    def publish_shed(self, request_id: str, why: str, retry_after_s: float) -> None:
        self._publish([Output(request_id, [], finished=True, finish_reason=FINISH_ERROR, error_code=503,
                              error=f"the server cannot start the request in time: {why}",
                              retry_after_s=retry_after_s)])

    def unfinished_requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.retire_unregistered_adapters()
        self._prompt.drop(request_id)
        if self.proposer is not None:
            self.proposer.drop(request_id)
        if not self.scheduler.has_unfinished:
            self.stepper.drain()

    def step(self) -> None:
        """One iteration of the scheduling mode's loop (steppers.py). One message crosses the ranks
        per step: the plan (the sampled tokens reach the other ranks within the step)."""
        self.num_steps += 1
        sched = self.scheduler
        for req in sched.take_expired():  # (waiting requests whose deadline a step from now would pass)
            self.publish_shed(req.request_id, "its deadline passed while it waited",
                              sched.slo.step_times.recent_p90 or 0.0)
        if self.tier_loads is not None and sched.waiting:
            self.tier_loads.before_schedule(sched)
        # the step-time model learns from the time between two steps' starts, what a decoding request
        # waits between two tokens (the loop's own work between steps included), when no idle wait came between
        started = time.perf_counter()
        if self._busy_since is not None:
            sched.observe_step(started - self._busy_since)
        self.stepper.step()
        self.retire_unregistered_adapters()
        self._busy_since = started if sched.has_unfinished else None
        if self._forecasting:  # what the IO thread sheds arrivals by
            self._forecast = sched.slo.forecast(sched.running, sched.waiting, sched.max_num_seqs,
                                                sched.max_num_batched_tokens, self.num_taken)

    # -- what the steppers call --------------------------------------------------------------------
    def run_plan(self, plan: StepPlan, pipelined: bool) -> StepResult | None:
        """The runners' part of a step: sync → this plan's result; pipelined → the previous plan's."""
        if self.tier_loads is not None:
            plan.kv_saves = self.tier_loads.saves()
        return self.paged.call(Execute(plan, pipelined))

    def flush(self) -> StepResult | None:
        return self.paged.call(Flush())

    def fail_plans(self, plans: list[StepPlan], exc: Exception) -> None:
        victims = list(dict.fromkeys(rid for plan in plans for rid in plan.scheduled_ids
                                     if rid in self.scheduler.requests))
        for rid in victims:
            self.scheduler.abort(rid)
            self._prompt.drop(rid)
            if self.proposer is not None:
                self.proposer.drop(rid)
        self.fail_step(victims, exc, plans[-1].plan_id)  # plan ids count the steps

    def apply(self, plan: StepPlan, result: StepResult | None) -> None:
        """Apply a plan's results to the scheduler and publish its requests' new tokens."""
        requests = self.scheduler.requests
        rids, samples = (result.request_ids, result.samples) if result else ([], [])
        for rid, part in (result.prompt.items() if result else ()):
            if rid in requests:
                self._prompt.add(rid, part, requests[rid].num_prompt_tokens)
        sampled = {rid: s.token_ids for rid, s in zip(rids, samples)}
        before = {rid: requests[rid].num_generated_tokens for rid in rids if rid in requests}
        self.spec.count(plan.spec_token_ids, sampled)
        self.num_multi_steps += plan.num_steps > 1
        updated = self.scheduler.update(plan, sampled)
        index = {rid: i for i, rid in enumerate(rids)}
        outputs = []
        for req in updated:
            s = samples[index[req.request_id]]
            kept = req.num_generated_tokens - before[req.request_id]  # tokens past a stop are cut
            top = s.top_tokens[:kept] if req.sampling.top_n_tokens else []
            prompt_lp, prompt_top = self._prompt.take(req) if req.sampling.prompt_logprobs else (None, None)
            outputs.append(Output(req.request_id, s.token_ids[:kept], s.log_probs[:kept], top,
                                  req.is_finished, req.finish_reason, prompt_log_probs=prompt_lp,
                                  prompt_top_tokens=prompt_top))
            if req.is_finished and self.proposer is not None:
                self.proposer.drop(req.request_id)
            if req.is_finished and self.adapters is not None:
                self.adapters.finished(req)
        if outputs:
            self.publish(outputs)


class SpecStats:
    """Speculative decoding counters for /metrics: proposed and accepted tokens, verifications."""

    def __init__(self):
        self.proposed = self.accepted = self.verifications = 0

    def count(self, proposals: dict[str, list[int]], emitted: dict[str, list[int]]) -> None:
        for rid, draft in proposals.items():
            if rid in emitted:
                self.verifications += 1
                self.proposed += len(draft)
                self.accepted += len(emitted[rid]) - 1  # the last is the model's own token

    def metrics(self) -> dict[str, float]:
        n = self.verifications
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                "spec_verifications": n,
                "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                # tokens a verification emits on average: accepted proposals plus the model's own
                "spec_mean_accepted_length": (self.accepted + n) / n if n else 0.0}


class PromptLogprobBuffer:
    """The prompt log-probs of requests still in prefill (chunk by chunk), until their first token
    goes out with them. A prefill repeated after a preemption overwrites the same positions."""

    def __init__(self):
        self._parts: dict[str, tuple[list, list]] = {}

    def add(self, request_id: str, part: PromptLogprobs, num_prompt_tokens: int) -> None:
        lp, top = self._parts.setdefault(request_id, ([None] * num_prompt_tokens, [[] for _ in range(num_prompt_tokens)]))
        lp[part.start:part.start + len(part.log_probs)] = part.log_probs
        top[part.start:part.start + len(part.top_tokens)] = part.top_tokens

    def take(self, req: Request) -> tuple[list | None, list | None]:
        """On the request's first token: its prompt log-probs (the first prompt token has none)."""
        if req.num_generated_tokens != 1:
            return None, None
        lp, top = self._parts.pop(req.request_id, ([None] * req.num_prompt_tokens, [[]] * req.num_prompt_tokens))
        return lp, top if req.sampling.top_n_tokens else None

    def drop(self, request_id: str) -> None:
        self._parts.pop(request_id, None)
