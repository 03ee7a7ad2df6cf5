"""A gunicorn worker's connection to the engine: one DEALER socket owned by one IO thread.

Request threads hand frames to the IO thread through thread-local inproc PUSH sockets; the IO
thread sends them on through an outbox that never drops a frame (engines/process/ipc.py), and routes each
engine output to the queue of the request it belongs to. Request ids are the server's own (one
uuid per input), so two requests can never share a queue.

The IO thread also keeps a health snapshot fresh (a HEALTH round trip every HEALTH_REFRESH_S), so
that `/ping` answers from memory under any load instead of queueing behind generation traffic.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time

import zmq

from engines import protocol
from engines.process import ipc
from engines.protocol import (Abort, AdapterCommand, AdapterReply, Add, HandlerCall, HandlerReply, Health, HealthReply,
                              Output)

HEALTH_REFRESH_S = 0.5


class EngineClient:
    def __init__(self, address: str, hwm: int = ipc.high_water_mark(1000, 32), *, refresh_health: bool = False):
        self._ctx = zmq.Context()
        self._address = address
        self._inproc = f"inproc://client-out-{os.getpid()}-{id(self)}"
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._health_waiters: dict[int, queue.SimpleQueue] = {}
        self._nonces = itertools.count(1)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._refresh_health = refresh_health
        self._snapshot: HealthReply | None = None
        self._snapshot_at = 0.0
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self._inproc)
        self._dealer = ipc.configure(self._ctx.socket(zmq.DEALER), hwm)
        self._dealer.connect(address)
        self._outbox = ipc.Outbox(self._dealer)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="engine-client", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the IO thread and close the sockets (a model unloaded: its client is not needed any more)."""
        self._closed = True
        self._thread.join(timeout=2 * ipc.IDLE_POLL_MS / 1000 + 1.0)

    # -- request side -------------------------------------------------------------------------
    def add(self, request: Add | AdapterCommand) -> "queue.SimpleQueue[Output]":
        """Send a request; its outputs (or its reply) arrive on the returned queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id} is already in flight")
            self._streams[request.request_id] = q
        self._send(request)
        return q

    def command(self, msg: AdapterCommand | HandlerCall, timeout: float) -> AdapterReply | HandlerReply | None:
        """Send an adapter command (or a custom handler's call) and wait for its reply; None when none
        comes within `timeout` s."""
        return await_reply(self, msg, timeout)

    def abort(self, request_id: str) -> None:
        self.release(request_id)
        self._send(Abort(request_id))

    def release(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    @property
    def snapshot(self) -> HealthReply | None:
        """The latest health reply (kept fresh by the IO thread with refresh_health), no round trip."""
        return self._snapshot

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def health(self, timeout: float = 1.0, max_age: float = 0.0) -> HealthReply | None:
        """The engine's state: the snapshot when it is at most `max_age` seconds old, else a round trip;
        None when the engine does not answer within `timeout` seconds."""
        if max_age and self._snapshot is not None and time.monotonic() - self._snapshot_at <= max_age:
            return self._snapshot
        nonce = next(self._nonces)
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._health_waiters[nonce] = q
        try:
            self._send(Health(nonce))
            return q.get(timeout=timeout)
        except queue.Empty:
            return None
        finally:
            with self._lock:
                self._health_waiters.pop(nonce, None)

    def _send(self, msg) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)  # the IO thread takes everything at once: never block here
            push.connect(self._inproc)
        push.send(protocol.encode(msg))

    # -- IO thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        asked_at = 0.0
        while not self._closed:
            events = dict(poller.poll(self._outbox.poll_timeout_ms()))
            if self._refresh_health and self._should_refresh(asked_at):
                asked_at = time.monotonic()
                self._outbox.put([protocol.encode(Health(0))])
            if self._pull in events:
                ipc.drain(self._pull, self._outbox.put)
            self._outbox.flush()
            if self._dealer in events:
                ipc.drain(self._dealer, lambda frames: self._route(protocol.decode_from_engine(frames[0])))
        self._pull.close()
        self._dealer.close()

    def _should_refresh(self, asked_at: float) -> bool:
        """One refresh in flight at a time (a loading or stuck engine is not flooded), retried after 5 s."""
        since = time.monotonic() - asked_at
        return since >= HEALTH_REFRESH_S and (self._snapshot_at >= asked_at or since >= 5.0)

    def _route(self, msg) -> None:
        with self._lock:
            if isinstance(msg, HealthReply):
                self._snapshot, self._snapshot_at = msg, time.monotonic()
                q = self._health_waiters.get(msg.nonce)
            else:
                q = self._streams.get(msg.request_id)
                if q is not None and (not isinstance(msg, Output) or msg.finished):
                    del self._streams[msg.request_id]
        if q is not None:
            q.put(msg)


def await_reply(sender, msg, timeout: float):
    """Send a one-reply message through `sender` (an EngineClient or an EnginePool) and wait for the reply;
    None when none comes within `timeout` seconds (the request id is released either way)."""
    q = sender.add(msg)
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None
    finally:
        sender.release(msg.request_id)

