"""A gunicorn worker's connection to the engine: one DEALER socket owned by one IO thread.

Request threads hand frames to the IO thread through thread-local inproc PUSH sockets; the IO
thread routes each engine output to the queue of the request it belongs to.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading

import zmq

from engines import protocol
from engines.protocol import Abort, Add, Health, HealthReply, Output


class EngineClient:
    def __init__(self, address: str):
        self._ctx = zmq.Context()
        self._address = address
        self._inproc = f"inproc://client-out-{os.getpid()}-{id(self)}"
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._health_waiters: dict[int, queue.SimpleQueue] = {}
        self._nonces = itertools.count(1)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(address)
        self._thread = threading.Thread(target=self._loop, name="engine-client", daemon=True)
        self._thread.start()

    # -- request side -------------------------------------------------------------------------
    def add(self, request: Add) -> "queue.SimpleQueue[Output]":
        """Send a request; its outputs arrive on the returned queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._streams[request.request_id] = q
        self._send(request)
        return q

    def abort(self, request_id: str) -> None:
        self.release(request_id)
        self._send(Abort(request_id))

    def release(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def health(self, timeout: float = 1.0) -> HealthReply | None:
        """The engine's state, or None when it does not answer within `timeout` seconds."""
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
            push.connect(self._inproc)
        push.send(protocol.encode(msg))

    # -- IO thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._pull in events:
                while True:
                    try:
                        self._dealer.send(self._pull.recv(zmq.NOBLOCK), zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._dealer in events:
                while True:
                    try:
                        frame = self._dealer.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._route(protocol.decode_from_engine(frame))

    def _route(self, msg) -> None:
        with self._lock:
            if isinstance(msg, HealthReply):
                q = self._health_waiters.get(msg.nonce)
            else:
                q = self._streams.get(msg.request_id)
                if q is not None and msg.finished:
                    del self._streams[msg.request_id]
        if q is not None:
            q.put(msg)
