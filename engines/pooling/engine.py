"""The pooling engine (option.task text-embedding or text-classification): Encode requests in, one vector
per input out (engines/protocol.py Encode / Encoded).

The loop takes waiting inputs in arrival order while the batch stays under `max_num_seqs` inputs and
`max_num_batched_tokens` tokens, sorts them by length and splits them into groups whose padded size
(inputs × the longest) stays under the token budget, so that short inputs never pad to a long one's
length; a request is answered once all its inputs have their vectors. Inputs from many requests share a
forward pass: that is where the speed over one `encode` call per request comes from.

    schedule: take inputs (FIFO, budgets)  →  groups by length  →  model.run per group  →  publish done requests
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

import torch

from engines.config import TASK_CLASSIFICATION, LmiConfig
from engines.pooling.model import PoolingModel, finish_vectors
from engines.protocol import (FINISH_ERROR, Abort, AdapterCommand, AdapterReply, Add, Encode, Encoded, HandlerCall,
                              HandlerReply, HealthReply, Output)

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One Encode and the vectors of its inputs so far ([H] each, before the cut and normalisation)."""

    msg: Encode
    vectors: list[torch.Tensor | None] = field(default_factory=list)
    num_done: int = 0


class PoolingEngine:
    def __init__(self, config: LmiConfig, publish):
        self.config = config
        self.spec = config.model.pooling
        self._publish = publish
        self.model = PoolingModel(config.model)
        self._jobs: dict[str, Job] = {}
        self._waiting: collections.deque[tuple[str, int]] = collections.deque()  # (request id, input index)
        self._ready = threading.Condition()
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = max(sched.max_num_batched_tokens, self.spec.max_input_tokens)
        self.num_batches = 0
        self.num_running = 0
        routes = "/rerank, /v1/score or /invocations" if self.spec.task == TASK_CLASSIFICATION else \
            "/v1/embeddings, /embed, /v1/score or /invocations"
        self.wrong_route = f"this model serves {self.spec.task} (option.task), not text generation: use {routes}"

    def load(self) -> None:
        self.model.load()
        self.model.run([[self.model.pad_id] * 4])  # warm-up: the first forward's one-off costs

    # -- messages ----------------------------------------------------------------------------------------------
    def submit(self, msg) -> None:
        if isinstance(msg, Encode):
            self._accept(msg)
        elif isinstance(msg, Abort):
            with self._ready:
                self._jobs.pop(msg.request_id, None)  # its waiting inputs are skipped when their turn comes
        elif isinstance(msg, Add):
            self._publish([Output(msg.request_id, [], finished=True, finish_reason=FINISH_ERROR, error_code=400,
                                  error=self.wrong_route)])
        elif isinstance(msg, AdapterCommand):
            self._publish([AdapterReply(msg.request_id, 404, "this model has no LoRA adapters (a pooling model)")])
        elif isinstance(msg, HandlerCall):
            self._publish([HandlerReply(msg.request_id, 400, "not a custom handler", {},
                                        [(None, self.wrong_route.encode())])])

    def _accept(self, msg: Encode) -> None:
        limit = self.spec.max_input_tokens
        bad = next((i for i, ids in enumerate(msg.inputs) if not ids or len(ids) > limit), None)
        if bad is not None or not msg.inputs or (msg.token_type_ids and len(msg.token_type_ids) != len(msg.inputs)):
            why = "no inputs" if not msg.inputs else "token_type_ids do not match the inputs" if bad is None else \
                f"input {bad} has {len(msg.inputs[bad])} tokens; this model takes 1 to {limit}"
            self._publish([Encoded(msg.request_id, error_code=400, error=why)])
            return
        with self._ready:
            if len(self._waiting) + len(msg.inputs) > self.config.scheduler.job_queue_size:
                self._publish([Encoded(msg.request_id, error_code=503,
                                       error="the request queue is full (job_queue_size inputs waiting)")])
                return
            self._jobs[msg.request_id] = Job(msg, [None] * len(msg.inputs))
            self._waiting.extend((msg.request_id, i) for i in range(len(msg.inputs)))
            self._ready.notify()

    def health(self, state: str) -> HealthReply:
        return HealthReply(state, num_waiting=len(self._waiting), num_running=self.num_running,
                           num_batches=self.num_batches)

    def stop_ranks(self) -> None:
        """One process: nothing to stop."""

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._ready:
                batch = self._schedule()
                if not batch:
                    self._ready.wait(timeout=0.2)
                    continue
            self.num_running = len(batch)
            for group in groups_by_length(batch, self.max_num_batched_tokens):
                self._execute(group)
            self.num_running = 0

    def _schedule(self) -> list[tuple[str, int, list[int], list[int]]]:
        """Waiting inputs in arrival order under the budgets: (request id, index, ids, token types)."""
        batch, tokens = [], 0
        while self._waiting and len(batch) < self.max_num_seqs:
            rid, i = self._waiting[0]
            job = self._jobs.get(rid)
            if job is None:  # aborted
                self._waiting.popleft()
                continue
            ids = job.msg.inputs[i]
            if batch and tokens + len(ids) > self.max_num_batched_tokens:
                break
            self._waiting.popleft()
            batch.append((rid, i, ids, job.msg.token_type_ids[i] if job.msg.token_type_ids else []))
            tokens += len(ids)
        return batch

    def _execute(self, group: list[tuple[str, int, list[int], list[int]]]) -> None:
        try:
            out = self.model.run([ids for _, _, ids, _ in group],
                                 [types for *_, types in group] if group[0][3] else None)  # [g, H]
        except Exception as exc:  # noqa: BLE001 — the step's requests fail, the engine goes on
            oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            log.exception("pooling batch of %d inputs failed", len(group))
            self._fail({rid for rid, *_ in group}, 507 if oom else 424,
                       f"{'out of memory' if oom else 'the model failed'}: {type(exc).__name__}: {exc}")
            return
        self.num_batches += 1
        done = []
        with self._ready:
            for row, (rid, i, _, _) in enumerate(group):
                job = self._jobs.get(rid)
                if job is None or job.vectors[i] is not None:
                    continue
                job.vectors[i] = out[row]
                job.num_done += 1
                if job.num_done == len(job.vectors):
                    done.append(self._jobs.pop(rid))
        if done:
            self._publish([self._reply(job) for job in done])

    def _reply(self, job: Job) -> Encoded:
        vectors = torch.stack(job.vectors)  # [n, H]
        if self.spec.task != TASK_CLASSIFICATION:
            normalize = self.spec.normalize if job.msg.normalize is None else job.msg.normalize
            vectors = finish_vectors(vectors, job.msg.dimensions, normalize)
        data = vectors.contiguous().numpy().astype("<f4", copy=False)  # (a copy only on a big-endian host)
        return Encoded(job.msg.request_id, [row.tobytes() for row in data])

    def _fail(self, request_ids: set[str], code: int, why: str) -> None:
        with self._ready:
            failed = [rid for rid in request_ids if self._jobs.pop(rid, None) is not None]
        self._publish([Encoded(rid, error_code=code, error=why) for rid in failed])


def groups_by_length(batch: list, max_tokens: int) -> list[list]:
    """The batch sorted by input length and cut into groups whose padded size (members × the longest, which
    is the last) stays within max_tokens; a lone input longer than that is a group of its own."""
    groups: list[list] = []
    for item in sorted(batch, key=lambda item: len(item[2])):
        if groups and (len(groups[-1]) + 1) * len(item[2]) <= max_tokens:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups
