"""Several model copies behind one front end (maxWorkers; docs/copies.md): one EngineClient per copy.

A request goes to the copy with the fewest outstanding tokens among those that serve (ready in their
health snapshot, not dead), counted by this worker: prompt + max_new_tokens of each request it sent
there and has not released. Every later call for the request (abort, release) goes to the same
copy. Health is the copies' together: ready while at least one copy is; each copy's own reply is
`healths()` (/metrics labels them).
"""

from __future__ import annotations

import queue
import random
import threading

from engines.process import ipc
from engines.protocol import STATE_READY, Add, HandlerCall, HealthReply
from engines.process.rundir import copy_dirs, engine_socket_path, read_failure
from handlers.engine_client import EngineClient, await_reply


class EnginePool:
    def __init__(self, run_dir: str, copies: int, hwm: int = ipc.high_water_mark(1000, 32)):
        self.dirs = copy_dirs(run_dir, copies)
        self.clients = [EngineClient(engine_socket_path(d), hwm, refresh_health=True) for d in self.dirs]
        self._lock = threading.Lock()
        self._where: dict[str, tuple[int, int]] = {}  # request id → (copy, its tokens)
        self._load = [0] * copies  # outstanding tokens per copy (this worker's requests)
        self._turn = random.randrange(copies)  # where ties start (each worker somewhere else)

    def dead(self, index: int) -> str | None:
        return read_failure(self.dirs[index], "engine")

    def copy_of(self, request_id: str) -> int | None:
        entry = self._where.get(request_id)
        return entry[0] if entry else None

    def _choose(self) -> int:
        serving = []
        n = len(self.clients)
        self._turn += 1
        for i, client in enumerate(self.clients):
            if self.dead(i):
                continue
            snap = client.snapshot
            # ready first, then the fewest outstanding tokens, then in turn (ties do not all go to copy 0)
            serving.append((snap is None or snap.state != STATE_READY, self._load[i], (i - self._turn) % n, i))
        if not serving:  # all dead: the first answers (and fails) as one copy would
            return 0
        return min(serving)[3]

    def add(self, request) -> "queue.SimpleQueue":
        cost = len(request.prompt_token_ids) + request.sampling.max_new_tokens if isinstance(request, Add) else 1
        with self._lock:
            index = self._choose()
            self._where[request.request_id] = (index, cost)
            self._load[index] += cost
        try:
            return self.clients[index].add(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    def command(self, msg, timeout: float):
        if isinstance(msg, HandlerCall):
            return await_reply(self, msg, timeout)
        return self.clients[0].command(msg, timeout)  # (adapter commands: one copy; LoRA runs with one)

    def abort(self, request_id: str) -> None:
        index = self.copy_of(request_id)
        self._forget(request_id)
        if index is not None:
            self.clients[index].abort(request_id)

    def release(self, request_id: str) -> None:
        index = self.copy_of(request_id)
        self._forget(request_id)
        if index is not None:
            self.clients[index].release(request_id)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            entry = self._where.pop(request_id, None)
            if entry is not None:
                self._load[entry[0]] -= entry[1]

    def healths(self, timeout: float = 1.0, max_age: float = 0.0) -> list[HealthReply | None]:
        return [c.health(timeout, max_age) for c in self.clients]

    def health(self, timeout: float = 1.0, max_age: float = 0.0) -> HealthReply | None:
        """The copies together: ready while one is (else the first one's state), counts summed."""
        replies = [r for r in self.healths(timeout, max_age) if r is not None]
        if not replies:
            return None
        ready = [r for r in replies if r.state == STATE_READY]
        first = (ready or replies)[0]
        return HealthReply(first.state, detail=first.detail, num_waiting=sum(r.num_waiting for r in replies),
                           num_running=sum(r.num_running for r in replies),
                           num_batches=sum(r.num_batches for r in replies),
                           num_kv_slots=sum(r.num_kv_slots for r in replies), startup=first.startup)
