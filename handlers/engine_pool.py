"""Several model copies behind one front end (maxWorkers; docs/copies.md): one EngineClient per copy.

A request goes to the copy with the fewest outstanding tokens among those that serve (ready in their
health snapshot and by their ready file, not dead), counted by this worker: prompt + max_new_tokens of each request it sent
there and has not released. Every later call for the request (abort, release) goes to its copy. A
request whose copy died before any of its output arrived is re-sent (`resend`, asked by its
Generation): it is then counted on, and later calls go to, the copy it was re-sent to. Health is the
copies' together: ready while at least one copy is; each copy's own reply is `healths()` (/metrics
labels them)."""

from __future__ import annotations

import os
import queue
import random
import threading

from engines.process import ipc
from engines.protocol import STATE_READY, Add, HandlerCall, HealthReply
from engines.process.rundir import copy_dirs, engine_socket_path, read_failure, ready_path
from handlers.engine_client import EngineClient, await_reply


class EnginePool:
    def __init__(self, run_dir: str, copies: int, hwm: int = ipc.high_water_mark(1000, 32)):
        self.dirs = copy_dirs(run_dir, copies)
        self.clients = [EngineClient(engine_socket_path(d), hwm, refresh_health=True) for d in self.dirs]
        self._lock = threading.Lock()
        # request id → (copy, its tokens, the request, the copy's life when it was sent there)
        self._where: dict[str, tuple[int, int, object, tuple | None]] = {}
        self._load = [0] * copies  # outstanding tokens per copy (this worker's requests)
        self._turn = random.randrange(copies)  # where ties start (each worker somewhere else)

    def dead(self, index: int) -> str | None:
        return read_failure(self.dirs[index], "engine")

    def copy_of(self, request_id: str) -> int | None:
        entry = self._where.get(request_id)
        return entry[0] if entry else None

    def copy_died(self, request_id: str) -> tuple[int, str] | None:
        """(its copy, why) when the copy the request was sent to has died since: dead now, or already
        restarted (the launcher restarts a copy 1.5 s after its death, which a request not watched
        meanwhile, e.g. the second input of a reply, would otherwise never learn)."""
        entry = self._where.get(request_id)
        if entry is None:
            return None
        index, _, _, life = entry
        reason = self.dead(index)
        if reason is None and life is not None and self._life(index) != life:
            reason = "the engine died and was restarted"
        return (index, reason) if reason else None

    def _life(self, index: int) -> tuple[int, int] | None:
        """Which life of copy `index` serves: its ready file's identity (each engine that gets ready
        creates it anew; a restart removes the old one), None while none is ready. A request sent
        while none is ready waits for the engine that gets ready next, and is not lost by its start."""
        try:
            st = os.stat(ready_path(self.dirs[index]))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _choose(self, exclude: int | None = None) -> int | None:
        """The copy for a new request: among those that serve (not dead, not `exclude`), None if none does."""
        serving = []
        n = len(self.clients)
        self._turn += 1
        for i, client in enumerate(self.clients):
            if i == exclude or self.dead(i):
                continue
            snap = client.snapshot
            # a restarted copy's snapshot is its last life's until its engine answers: no ready file, not ready
            loading = snap is None or snap.state != STATE_READY or self._life(i) is None
            # ready first, then the fewest outstanding tokens, then in turn (ties do not all go to copy 0)
            serving.append((loading, self._load[i], (i - self._turn) % n, i))
        return min(serving)[3] if serving else None

    def add(self, request) -> "queue.SimpleQueue":
        with self._lock:
            index = self._choose()
            if index is None:  # all dead: the first answers (and fails) as one copy would
                index = 0
            self._place(request, index)
        return self._send(index, request)

    def resend(self, request_id: str) -> "queue.SimpleQueue | None":
        """Send a request again, to another copy that serves; its stream on the copy it leaves is aborted
        and its tokens counted there no more. For a request none of whose output arrived (its copy died):
        the caller decides that. None, and nothing changed, when no other copy serves."""
        with self._lock:
            entry = self._where.get(request_id)
            index = self._choose(exclude=entry[0]) if entry else None
            if index is None:
                return None
            self._unplace(request_id)
            self._place(entry[2], index)
        # the abort also reaches a restarted engine that gets the Add still waiting in the outbox
        self.clients[entry[0]].abort(request_id)
        return self._send(index, entry[2])

    def _place(self, request, index: int) -> None:
        """Count the request on copy `index` (under the lock)."""
        cost = len(request.prompt_token_ids) + request.sampling.max_new_tokens if isinstance(request, Add) else 1
        self._where[request.request_id] = (index, cost, request, self._life(index))
        self._load[index] += cost

    def _unplace(self, request_id: str) -> None:
        """Count the request nowhere any more (under the lock)."""
        entry = self._where.pop(request_id, None)
        if entry is not None:
            self._load[entry[0]] -= entry[1]

    def _send(self, index: int, request) -> "queue.SimpleQueue":
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
            self._unplace(request_id)

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
