"""Rolling (continuous) batching over a padded KV cache.

One step:
    admit waiting requests (row, token and KV-weight limits)  → prefill them as a new batch,
    sample their first token, concatenate them into the running batch;
    decode one token for every running row; retire finished rows (filter + trim); publish.
Messages from the HTTP side (ADD / ABORT) arrive on a thread-safe inbox and are taken between steps.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading

import torch

from engines.config import LmiConfig, memory_bytes, model_max_len
from engines.core.admission import AdmissionLimits, admit, fits_alone
from engines.core.request import Request, Status
from engines.protocol import FINISH_ERROR, Abort, Add, HealthReply, Output
from engines.worker.model_runner import ModelRunner
from engines.worker.padded_cache import PaddedKVCache
from engines.worker.sampler import Sampler

log = logging.getLogger(__name__)


class _StepOutput:
    """What one step produced for one request (prefill and decode may both add a token)."""

    def __init__(self, req: Request):
        self.req = req
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.top_tokens: list[list[tuple[int, float]]] = []

    def to_output(self) -> Output:
        r = self.req
        return Output(r.request_id, self.token_ids, self.log_probs, self.top_tokens, r.is_finished, r.finish_reason)

DEFAULT_CPU_KV_FRACTION = "0.25"  # of available RAM, when option.kv_cache_memory is unset


class RollingEngine:
    def __init__(self, config: LmiConfig, publish, comm=None):
        self.config = config
        self._publish = publish
        self.runner = ModelRunner(config.model, model_max_len(config.model.local_dir, config.model.max_model_len),
                                  comm)
        self.sampler = Sampler(self.runner.device)
        self.inbox: "queue.SimpleQueue[Add | Abort]" = queue.SimpleQueue()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.cache: PaddedKVCache | None = None
        self.num_steps = 0
        self._arrivals = 0
        self.limits: AdmissionLimits | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def load(self) -> None:
        self.runner.load()
        budget = self._kv_budget_bytes()
        per_token = self.runner.kv_bytes_per_token
        sched = self.config.scheduler
        self.limits = AdmissionLimits(sched.max_num_seqs, sched.max_num_batched_tokens, budget // per_token)
        log.info("KV cache budget: %d bytes = %d token slots (%d bytes per token); max_num_seqs %d, "
                 "max_num_batched_tokens %d", budget, self.limits.max_kv_tokens, per_token,
                 sched.max_num_seqs, sched.max_num_batched_tokens)

    def _kv_budget_bytes(self) -> int:
        sched = self.config.scheduler
        if self.runner.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.runner.device)
            used = total - free
            return max(int(total * sched.gpu_memory_utilization) - used, 0)
        return memory_bytes(sched.kv_cache_memory or DEFAULT_CPU_KV_FRACTION, _available_ram())

    # -- the HTTP side ----------------------------------------------------------------------------
    def submit(self, msg: Add | Abort) -> None:
        self.inbox.put(msg)

    def health(self, state: str) -> HealthReply:
        cache = self.cache
        return HealthReply(state, num_waiting=len(self.waiting), num_running=len(self.running),
                           num_batches=self.num_steps, num_kv_slots=cache.num_tokens() if cache else 0)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._take_messages(block=not (self.waiting or self.running))
            if self.waiting or self.running:
                self.step()

    def _take_messages(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Add | Abort) -> None:
        if isinstance(msg, Abort):
            self._abort(msg.request_id)
            return
        if len(self.waiting) >= self.config.scheduler.job_queue_size:
            self._publish([_error(msg.request_id, 503, "the request queue is full "
                                  f"(job_queue_size={self.config.scheduler.job_queue_size})")])
            return
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling, self.runner.eos_token_ids, self._arrivals)
        self._arrivals += 1
        if not fits_alone(req, self.limits):
            self._publish([_error(req.request_id, 507, f"the request needs more KV cache than the budget of "
                                  f"{self.limits.max_kv_tokens} token slots; lower max_new_tokens or the prompt")])
            return
        self.waiting.append(req)

    def _abort(self, request_id: str) -> None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return
        for req in self.running:
            if req.request_id == request_id and not req.is_finished:
                req.abort()  # its row goes at the end of this step

    def step(self) -> None:
        self.num_steps += 1
        outputs: dict[str, _StepOutput] = {}
        new = admit(self.waiting, self.running, self.limits)
        try:
            if new:
                self._prefill(new, outputs)
            if self.running:
                live = [r for r in self.running if not r.is_finished]
                if live:
                    logits = self.runner.decode(self.cache, [r.output_token_ids[-1] for r in self.running])
                    self._sample(self.running, logits, outputs, skip_finished=True)
        except Exception as exc:  # a failed step fails its requests, not the engine
            self._fail_all(new, exc)
            return
        self._retire()
        self._publish([out.to_output() for out in outputs.values()])

    def _prefill(self, new: list[Request], outputs: dict[str, _StepOutput]) -> None:
        for req in new:
            req.status = Status.RUNNING
            self.sampler.add(req.request_id, req.sampling)
        logits, cache = self.runner.prefill([r.prompt_token_ids for r in new])
        self._sample(new, logits, outputs)
        keep = [i for i, r in enumerate(new) if not r.is_finished]
        for r in new:
            if r.is_finished:
                self.sampler.remove(r.request_id)
        if keep:
            cache = cache if len(keep) == len(new) else cache.filter(keep)
            self.cache = cache if self.cache is None else self.cache.concatenate(cache)
            self.running += [new[i] for i in keep]

    def _sample(self, rows: list[Request], logits: torch.Tensor, outputs: dict[str, _StepOutput],
                skip_finished: bool = False) -> None:
        params = [r.sampling for r in rows]
        seen = [r.prompt_token_ids + r.output_token_ids if r.sampling.repetition_penalty != 1.0 else []
                for r in rows]
        result = self.sampler.sample(logits, [r.request_id for r in rows], params, seen)
        for i, req in enumerate(rows):
            if skip_finished and req.is_finished:
                continue
            req.append_token(result.token_ids[i])
            out = outputs.setdefault(req.request_id, _StepOutput(req))
            out.token_ids.append(result.token_ids[i])
            out.log_probs.append(result.log_probs[i])
            if req.sampling.top_n_tokens:
                out.top_tokens.append(result.top_tokens[i])

    def _retire(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.is_finished]
        if len(keep) == len(self.running):
            return
        for r in self.running:
            if r.is_finished:
                self.sampler.remove(r.request_id)
        self.running = [self.running[i] for i in keep]
        self.cache = self.cache.filter(keep) if keep else None  # an empty batch holds no KV memory

    def _fail_all(self, new: list[Request], exc: Exception) -> None:
        oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
        code = 507 if oom else 424
        if not oom:
            log.exception("step %d failed", self.num_steps)
        victims = {r.request_id: r for r in self.running + new}
        for r in victims.values():
            self.sampler.remove(r.request_id)
        self.running, self.cache = [], None
        what = "out of memory" if oom else "the model failed during generation"
        self._publish([_error(rid, code, f"{what}: {exc}") for rid in victims])


def _error(request_id: str, code: int, message: str) -> Output:
    return Output(request_id, [], finished=True, finish_reason=FINISH_ERROR, error_code=code, error=message)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
