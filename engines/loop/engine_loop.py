"""What the rolling engines share: the inbox, the queue bound, the loop, the KV budget, errors.

Messages from the HTTP side (ADD / ABORT) arrive on a thread-safe inbox (the endpoint's IO thread
puts them there) and are taken between steps; the loop blocks on the inbox only when idle. The
loop also keeps the health snapshot that the IO thread answers HEALTH with: the engine's state is
only ever read by the thread that changes it.
"""

from __future__ import annotations

import abc
import logging
import os
import queue
import threading
import time
from typing import Callable

import msgspec
import torch

from engines.config import LmiConfig, SchedulerConfig, memory_bytes
from engines.weights.memory_plan import available_ram, cpu_kv_budget_bytes
from engines.process.errors import FatalStepError, is_out_of_memory
from engines.protocol import FINISH_ERROR, STATE_READY, Abort, AdapterCommand, AdapterReply, Add, HealthReply, Output

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.02  # how often a busy loop refreshes its health snapshot


class EngineLoop(abc.ABC):
    def __init__(self, config: LmiConfig, publish, comm):
        self.config = config
        self.comm = comm
        self.on_stuck: Callable[[str], None] = lambda reason: None  # the engine process says it is dead
        self._publish = publish
        self.inbox: "queue.SimpleQueue[Add | Abort]" = queue.SimpleQueue()
        self.num_steps = 0
        self.num_taken = 0  # requests taken from the inbox
        self._step_started: float | None = None
        self._snapshot = HealthReply(STATE_READY)
        self._snapshot_at = 0.0
        self.adapters = None  # option.enable_lora: engines/worker/lora_registry.LoraRegistry (set by load)

    # -- what each engine provides ----------------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests waiting for admission."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Anything waiting or running."""

    @abc.abstractmethod
    def add(self, msg: Add) -> None:
        """Take a new request (the queue bound is checked already)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is."""

    @abc.abstractmethod
    def step(self) -> None:
        """One engine iteration."""

    @abc.abstractmethod
    def measure(self) -> HealthReply:
        """The engine's statistics now (called on the loop's thread only)."""

    def command(self, msg: AdapterCommand) -> None:
        """A LoRA adapter registered or unregistered at run time."""
        if self.adapters is None:
            return self.reply(msg, 404, "LoRA adapters are served with option.enable_lora=true; this server runs "
                                        "without them")
        self.adapters.command(msg, self.unfinished_requests())

    def retire_unregistered_adapters(self) -> None:
        """Adapters asked to go leave once no request uses them (between steps; nothing to do, and no
        request map built, while none is being unregistered)."""
        if self.adapters is not None and self.adapters.unregistering:
            self.adapters.retire_unused(self.unfinished_requests())

    def unfinished_requests(self) -> dict:
        """Request id → Request, waiting or running (the LoRA registry's view)."""
        return {}

    def refuses_adapter(self, msg: Add) -> bool:
        """A request for an adapter not served now is a 404 (never the base model's answer under an
        adapter's name): True when it was refused."""
        if msg.lora_name is None:
            return False
        refusal = self.adapters.refusal(msg.lora_name) if self.adapters is not None else \
            f"no LoRA adapter named {msg.lora_name!r}; this server serves: none (option.enable_lora is off)"
        if refusal:
            self.publish_error(msg.request_id, 404, refusal)
        return refusal is not None

    def refuses_grammar(self, msg: Add, grammars) -> bool:
        """A request whose grammar does not compile here (the HTTP worker checked it without the
        tokenizer) is a 400 naming why: True when it was refused. Compiling it now caches it."""
        if msg.sampling.grammar is None:
            return False
        try:
            grammars.compiled(msg.sampling.grammar)
            return False
        except ValueError as exc:
            self.publish_error(msg.request_id, 400, str(exc))
        except Exception as exc:  # noqa: BLE001 — the tokenizer could not be read as llguidance needs it
            log.error("constrained decoding is unavailable: %s", exc)
            self.publish_error(msg.request_id, 501, f"constrained decoding needs the model's tokenizer.json, which "
                                                    f"could not be read for it here: {exc}")
        return True

    def reply(self, msg: AdapterCommand, status: int, message: str) -> None:
        self._refresh_snapshot(force=True)  # the adapters listed from now on say what the reply says
        self._publish([AdapterReply(msg.request_id, status, message)])

    # -- shared -------------------------------------------------------------------------------------
    def submit(self, msg: Add | Abort | AdapterCommand) -> None:
        self.inbox.put(msg)

    def health(self, state: str) -> HealthReply:
        """The latest snapshot (any thread: it is replaced whole, never mutated)."""
        return msgspec.structs.replace(self._snapshot, state=state)

    def run(self, stop: threading.Event) -> None:
        watchdog = threading.Thread(target=self._watch, args=(stop,), name="step-watchdog", daemon=True)
        watchdog.start()
        self._refresh_snapshot(force=True)
        while not stop.is_set():
            self._take_messages(block=not self.has_work())
            if self.has_work():
                self._step_started = time.monotonic()
                self.step()
                self._step_started = None
            self._refresh_snapshot(force=not self.has_work())

    def _refresh_snapshot(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._snapshot_at >= SNAPSHOT_INTERVAL_S:
            self._snapshot, self._snapshot_at = self.measure(), now

    def _watch(self, stop: threading.Event) -> None:
        """A step stuck beyond option.predict_timeout (a hung rank, a wedged device) ends the process:
        the launcher then fails the requests in flight and exits, and SageMaker replaces the container."""
        limit = self.config.scheduler.predict_timeout_s
        while not stop.wait(0.5):
            started = self._step_started
            if started is not None and time.monotonic() - started > limit:
                reason = (f"step {self.num_steps} exceeded option.predict_timeout={limit:.0f} s (a rank, a device "
                          "or the network between the ranks is stuck)")
                log.error("%s: exiting", reason)
                self.on_stuck(reason)  # the HTTP workers answer 503 / 424 from now on, whatever mpirun does
                logging.shutdown()
                os._exit(4)

    def _take_messages(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, Abort):
                self.abort(msg.request_id)
            elif isinstance(msg, AdapterCommand):
                self.command(msg)
            else:
                self.take(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def take(self, msg: Add) -> None:
        """A request from the inbox: queued, unless the queue is full (503)."""
        self.num_taken += 1  # (counted as the IO thread counts what it let through: engines/core/forecast.py)
        if self.num_waiting >= self.config.scheduler.job_queue_size:
            self.publish_error(msg.request_id, 503, "the request queue is full "
                               f"(job_queue_size={self.config.scheduler.job_queue_size})")
        else:
            self.add(msg)

    def publish(self, outputs: list[Output]) -> None:
        if any(o.finished for o in outputs):  # a caller that has its answer reads /metrics that count it
            self._refresh_snapshot(force=True)
        self._publish(outputs)

    def publish_error(self, request_id: str, code: int, message: str) -> None:
        self._publish([Output(request_id, [], finished=True, finish_reason=FINISH_ERROR, error_code=code,
                              error=message)])

    def fail_step(self, request_ids: list[str], exc: Exception, step: int | None = None) -> None:
        """A failed step (by default the current one) fails its requests (424, or 507 when out of
        memory), not the engine; with tensor parallelism the ranks may be out of step, so it raises
        FatalStepError."""
        oom = is_out_of_memory(exc)
        step = self.num_steps if step is None else step
        if oom:
            log.error("step %d ran out of memory (%s); failing requests %s", step, exc, request_ids)
        else:
            log.error("step %d failed; failing requests %s", step, request_ids, exc_info=exc)
        what = "out of memory" if oom else "the model failed during generation"
        self._publish([Output(rid, [], finished=True, finish_reason=FINISH_ERROR, error_code=507 if oom else 424,
                              error=f"{what}: {exc}") for rid in request_ids])
        if self.comm.world_size > 1:
            raise FatalStepError(f"step {step} failed with tensor parallelism: {exc}") from exc


def kv_budget_bytes(sched: SchedulerConfig, runner, num_ranks: int, activation_peak: int, block_size: int = 1) -> int:
    """KV cache memory of one rank.

    CUDA: what gpu_memory_utilization of the GPU leaves after the weights and `activation_peak`, the
    memory peak of the profiling forward (ModelRunner.warm_up, which every rank runs). CPU: option.kv_cache_memory
    (bytes, or a fraction of available RAM) shared by the ranks, which all live in this machine's
    RAM; unset, what max_num_seqs sequences of max_model_len tokens need (engines/weights/memory_plan.py)."""
    if runner.device.type == "cuda":
        return cuda_kv_budget_bytes(sched, runner.device, activation_peak)
    if sched.kv_cache_memory:
        return memory_bytes(sched.kv_cache_memory, available_ram()) // num_ranks
    return cpu_kv_budget_bytes(runner.kv_bytes_per_token, sched.max_num_seqs, runner.max_model_len,
                               available_ram(), num_ranks, block_size)


def cuda_kv_budget_bytes(sched: SchedulerConfig, device: torch.device, peak: int) -> int:
    """total × gpu_memory_utilization − what is held now (weights, CUDA context) − the measured
    activation peak of a forward at max_num_batched_tokens (as vLLM sizes its cache)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = max(int(total * sched.gpu_memory_utilization) - (total - free) - peak, 0)
    log.info("CUDA memory: %d total, %d in use after loading, activation peak %d → KV budget %d bytes",
             total, total - free, peak, budget)
    return budget
