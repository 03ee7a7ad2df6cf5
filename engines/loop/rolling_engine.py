"""Rolling (continuous) batching over a padded KV cache.

One step:
    admit waiting requests (row, token and KV-weight limits)  → prefill them as a new batch,
    sample their first token, concatenate them into the running batch;
    decode one token for every running row; retire finished rows (filter + trim); publish.
"""

from __future__ import annotations

import collections
import logging

import torch

from engines.spec import ModelSpec
from engines.config import LmiConfig
from engines.core.admission import AdmissionLimits, admit, fits_alone
from engines.core.lora_slots import LoraSlots
from engines.core.request import Request, Status
from engines.process.startup import TIMELINE
from engines.protocol import FINISH_ABORT, STATE_READY, Add, HealthReply, Output
from engines.loop.engine_loop import EngineLoop, kv_budget_bytes
from engines.loop.lora_registry import LoraRegistry
from engines.dist import SingleProcess
from engines.worker.mirror import Decode, Merge, Mirrored, Prefill, Retire, WarmUp
from engines.worker.model_runner import ModelRunner
from engines.worker.padded_batch import PaddedBatch
from engines.worker.grammar import Grammars
from engines.worker.sampler import PromptLogprobs, Sampler

log = logging.getLogger(__name__)


class StepOutput:
    """What one step produced for one request (prefill and decode may both add a token)."""

    def __init__(self, req: Request):
        self.req = req
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.top_tokens: list[list[tuple[int, float]]] = []
        self.prompt: PromptLogprobs | None = None

    def add(self, token_id: int, log_prob: float, top: list[tuple[int, float]]) -> None:
        self.token_ids.append(token_id)
        self.log_probs.append(log_prob)
        if self.req.sampling.top_n_tokens:
            self.top_tokens.append(top)

    def to_output(self) -> Output:
        r = self.req
        prompt_lp = prompt_top = None
        if self.prompt is not None:  # the prefill step's output: the first prompt token has no log-prob
            prompt_lp = [None] + self.prompt.log_probs
            prompt_top = [[]] + self.prompt.top_tokens if r.sampling.top_n_tokens else None
        return Output(r.request_id, self.token_ids, self.log_probs, self.top_tokens, r.is_finished, r.finish_reason,
                      prompt_log_probs=prompt_lp, prompt_top_tokens=prompt_top)


class RollingEngine(EngineLoop):
    def __init__(self, config: LmiConfig, publish, comm=None):
        super().__init__(config, publish, comm or SingleProcess())
        self.runner = ModelRunner(config.model, ModelSpec.of(config.model), self.comm)
        self.batch = Mirrored(PaddedBatch(self.runner), self.comm)  # rows in the order of self.running
        self.sampler = Sampler(self.runner.device, frozenset(self.runner.spec.eos_token_ids),
                               Grammars(config.model.local_dir, self.runner.spec.vocab_size,
                                        self.runner.spec.eos_token_ids))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._arrivals = 0
        self.limits: AdmissionLimits | None = None

    def load(self) -> None:
        if self.config.model.kv_cache_dtype != "auto":
            raise ValueError(f"option.kv_cache_dtype={self.config.model.kv_cache_dtype}: the padded engine keeps "
                             "K/V in the model dtype; the paged engine stores fp8")
        self.runner.load()
        if self.runner.lora is not None:
            self.adapters = LoraRegistry(self.batch, LoraSlots(self.config.model.max_loras), self.reply)
        sched = self.config.scheduler
        with TIMELINE.phase("warm_up"):
            peak = self.batch.call(WarmUp(min(sched.max_num_batched_tokens, self.runner.max_model_len)))
        budget = kv_budget_bytes(sched, self.runner, self.comm.world_size, peak)
        per_token = self.runner.kv_bytes_per_token
        self.limits = AdmissionLimits(sched.max_num_seqs, sched.max_num_batched_tokens, budget // per_token)
        log.info("KV cache budget: %d bytes = %d token slots (%d bytes per token); max_num_seqs %d, "
                 "max_num_batched_tokens %d", budget, self.limits.max_kv_tokens, per_token,
                 sched.max_num_seqs, sched.max_num_batched_tokens)

    def measure(self) -> HealthReply:
        return HealthReply(STATE_READY, num_waiting=len(self.waiting), num_running=len(self.running),
                           num_batches=self.num_steps, num_kv_slots=self.batch.target.num_kv_slots(),
                           metrics=self.sampler.grammars.metrics(),
                           adapters=self.adapters.infos(self.unfinished_requests()) if self.adapters else [])

    def unfinished_requests(self) -> dict[str, Request]:
        return {r.request_id: r for r in (*self.waiting, *self.running) if not r.is_finished}

    def stop_ranks(self) -> None:
        self.batch.stop()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, msg: Add) -> None:
        if self.refuses_adapter(msg) or self.refuses_grammar(msg, self.sampler.grammars):
            return
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling, self.runner.eos_token_ids, self._arrivals,
                      msg.lora_name)
        self._arrivals += 1
        if not fits_alone(req, self.limits):
            self.publish_error(req.request_id, 507, "the request needs more KV cache than the budget of "
                               f"{self.limits.max_kv_tokens} token slots; lower max_new_tokens or the prompt")
            return
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.retire_unregistered_adapters()
                return
        for req in self.running:
            if req.request_id == request_id and not req.is_finished:
                req.abort()  # its row goes at the end of this step

    def step(self) -> None:
        self.num_steps += 1
        outputs: dict[str, StepOutput] = {}
        new = admit(self.waiting, self.running, self.limits, self.adapters.hold_slot if self.adapters else None)
        try:
            if new:
                self._prefill(new, outputs)
            if any(not r.is_finished for r in self.running):
                logits = self.batch.call(Decode([r.output_token_ids[-1] for r in self.running]))
                self._sample(self.running, logits, outputs)
        except Exception as exc:
            victims = {r.request_id: r for r in self.running + new}
            for rid, req in victims.items():
                self.sampler.remove(rid)
                if self.adapters is not None:
                    self.adapters.slots.let_go(req)
            self.running = []
            self.batch.target.reset()
            self.fail_step(list(victims), exc)
        else:
            self._retire()
            self.publish([out.to_output() for out in outputs.values()])
        self.retire_unregistered_adapters()

    def _prefill(self, new: list[Request], outputs: dict[str, StepOutput]) -> None:
        for req in new:
            req.status = Status.RUNNING
            self.sampler.add(req.request_id, req.sampling, req.prompt_token_ids)
        slots = [self.adapters.slots.slot_of[r.lora_name] if r.lora_name else 0 for r in new] if self.adapters else []
        logits, prompt = self.batch.call(Prefill([r.prompt_token_ids for r in new],
                                                 [r.sampling.top_n_tokens if r.sampling.prompt_logprobs else None
                                                  for r in new], slots))
        self._sample(new, logits, outputs)
        for i, part in prompt.items():
            if new[i].request_id in outputs:
                outputs[new[i].request_id].prompt = part
        keep = [i for i, r in enumerate(new) if not r.is_finished]
        for r in new:
            if r.is_finished:
                self._finish(r)
        self.batch.call(Merge(keep))
        self.running += [new[i] for i in keep]

    def _sample(self, rows: list[Request], logits: torch.Tensor, outputs: dict[str, StepOutput]) -> None:
        result = self.sampler.sample(logits, [r.request_id for r in rows])
        for i, req in enumerate(rows):
            if req.is_finished:  # aborted this step: its row is decoded but its token dropped
                continue
            req.append_token(result.token_ids[i])
            outputs.setdefault(req.request_id, StepOutput(req)).add(
                result.token_ids[i], result.log_probs[i], result.top_tokens[i])

    def _retire(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.is_finished]
        if len(keep) == len(self.running):
            return
        for r in self.running:
            if r.is_finished:
                self._finish(r)
        self.running = [self.running[i] for i in keep]
        self.batch.call(Retire(keep))

    def _finish(self, req: Request) -> None:
        """A finished (or aborted) row leaves: its sampler state, its LoRA slot."""
        self.sampler.remove(req.request_id)
        if self.adapters is not None:
            self.adapters.slots.let_go(req)
            if req.finish_reason != FINISH_ABORT:
                self.adapters.finished(req)
