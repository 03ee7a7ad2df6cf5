"""Dynamic batching, DJL's `engine=Python` baseline: queue, batch, `model.generate`, answer.

    t0: first request of a parameter group arrives → its clock starts
    the group closes when it holds `batch_size` prompts, or `max_batch_delay` has passed since t0
    the closed batch runs through HF `generate` left-padded; every request is answered at the end

Requests with different sampling parameters go to different groups (one `generate` call runs one
set of parameters). Waiting prompts beyond `job_queue_size` are refused with 503 at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec

from engines.spec import ModelSpec
from engines.config import LmiConfig
from engines.protocol import Abort, AdapterCommand, AdapterReply, Add, HealthReply, Output
from engines.sampling_params import SamplingParams
from engines.process.errors import is_out_of_memory

log = logging.getLogger(__name__)


@dataclass
class _Group:
    deadline: float
    requests: list[Add] = field(default_factory=list)


class DynamicBatcher:
    """Groups requests into batches; `next_batch` blocks until one is due. Thread-safe."""

    def __init__(self, batch_size: int, max_batch_delay_s: float, job_queue_size: int,
                 clock=time.monotonic):
        self.batch_size = batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self.job_queue_size = job_queue_size
        self._clock = clock
        self._groups: "collections.OrderedDict[SamplingParams, _Group]" = collections.OrderedDict()
        self._num_waiting = 0
        self._cond = threading.Condition()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def add(self, req: Add) -> bool:
        """Queue a request; False when the queue is full."""
        with self._cond:
            if self._num_waiting >= self.job_queue_size:
                return False
            group = self._groups.get(req.sampling)
            if group is None:
                group = self._groups[req.sampling] = _Group(self._clock() + self.max_batch_delay_s)
            group.requests.append(req)
            self._num_waiting += 1
            self._cond.notify()
            return True

    def abort(self, request_id: str) -> bool:
        with self._cond:
            for key, group in list(self._groups.items()):
                for i, req in enumerate(group.requests):
                    if req.request_id == request_id:
                        del group.requests[i]
                        self._num_waiting -= 1
                        if not group.requests:
                            del self._groups[key]
                        return True
        return False

    def next_batch(self, timeout: float | None = None) -> list[Add] | None:
        """The next due batch (oldest group first), or None after `timeout` seconds."""
        give_up = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                now = self._clock()
                batch = self._pop_due(now)
                if batch is not None:
                    return batch
                wake = min((g.deadline for g in self._groups.values()), default=None)
                if give_up is not None:
                    if now >= give_up:
                        return None
                    wake = give_up if wake is None else min(wake, give_up)
                self._cond.wait(None if wake is None else max(wake - now, 0.0))

    def _pop_due(self, now: float) -> list[Add] | None:
        for key, group in self._groups.items():
            if len(group.requests) >= self.batch_size or now >= group.deadline:
                batch = group.requests[: self.batch_size]
                rest = group.requests[self.batch_size:]
                if rest:  # an overfull group keeps its place and its (already passed) deadline
                    group.requests = rest
                else:
                    del self._groups[key]
                self._num_waiting -= len(batch)
                return batch
        return None


class DynamicEngine:
    """The engine loop for dynamic batching: take a due batch, generate, publish."""

    def __init__(self, config: LmiConfig, publish):
        from engines.dynamic.generator import HFGenerator

        sched = config.scheduler
        self.batcher = DynamicBatcher(sched.batch_size, sched.max_batch_delay_ms / 1000.0, sched.job_queue_size)
        self.generator = HFGenerator(config.model, ModelSpec.of(config.model))
        self._publish = publish
        self._num_batches = 0
        self._num_running = 0

    def load(self) -> None:
        self.generator.load()

    def submit(self, msg: Add | Abort | AdapterCommand) -> None:
        if isinstance(msg, Abort):
            self.batcher.abort(msg.request_id)
        elif isinstance(msg, AdapterCommand):
            self._publish([AdapterReply(msg.request_id, 404, "LoRA adapters are served by the paged engine with "
                                                             "option.enable_lora=true; this server runs without them")])
        elif msg.lora_name is not None:  # never the base model's answer under an adapter's name
            self._publish([Output(msg.request_id, [], finished=True, finish_reason="error", error_code=404,
                                  error=f"no LoRA adapter named {msg.lora_name!r}: LoRA adapters run in the paged "
                                        "engine (option.enable_lora)")])
        elif not self.batcher.add(msg):
            self._publish([Output(msg.request_id, [], finished=True, finish_reason="error", error_code=503,
                                  error=f"the request queue is full (job_queue_size={self.batcher.job_queue_size})")])

    def health(self, state: str) -> HealthReply:
        return HealthReply(state, num_waiting=self.batcher.num_waiting, num_running=self._num_running,
                           num_batches=self._num_batches)

    def stop_ranks(self) -> None:
        """One process: nothing to stop."""

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            batch = self.batcher.next_batch(timeout=0.2)
            if batch:
                self._run_batch(batch)

    def _run_batch(self, batch: list[Add]) -> None:
        self._num_batches += 1
        batch_id = self._num_batches
        self._num_running = len(batch)
        log.info("batch %d: %d prompts %s", batch_id, len(batch), [r.request_id for r in batch])
        started = time.perf_counter()
        try:
            outputs = self.generator.generate(batch)
        except Exception as exc:  # one failed batch fails its requests, not the engine
            ids = [r.request_id for r in batch]
            if is_out_of_memory(exc):
                log.error("batch %d ran out of memory (%s); failing requests %s", batch_id, exc, ids)
                outputs = [_failed(r, 507, f"out of memory during generation: {exc}") for r in batch]
            else:
                log.exception("batch %d failed; failing requests %s", batch_id, ids)
                outputs = [_failed(r, 424, f"the model failed during generation: {exc}") for r in batch]
        finally:
            self._num_running = 0
        log.info("batch %d: done in %.3f s", batch_id, time.perf_counter() - started)
        self._publish([msgspec.structs.replace(o, batch_id=batch_id) for o in outputs])


def _failed(req: Add, code: int, message: str) -> Output:
    return Output(req.request_id, [], finished=True, finish_reason="error", error_code=code, error=message)

