"""The engine's ZeroMQ side: one IO thread owns the ROUTER socket.

It answers HEALTH at once (also while the model is still loading), hands ADD/ABORT to the engine,
and sends the engine's outputs back to the worker socket each request came from. The engine thread
publishes through an inproc PUSH socket, so no ZeroMQ socket is ever used by two threads.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import msgspec
import zmq

from engines import protocol
from engines.protocol import Abort, Add, Health, HealthReply, Output

log = logging.getLogger(__name__)


class EngineEndpoint:
    def __init__(self, address: str, on_message: Callable[[Add | Abort], None],
                 health: Callable[[], HealthReply]):
        self._address = address
        self._on_message = on_message
        self._health = health
        self._ctx = zmq.Context.instance()
        self._inproc = f"inproc://engine-outputs-{id(self)}"
        self._owners: dict[str, bytes] = {}  # request id -> worker socket identity
        self._stop = threading.Event()
        self._local = threading.local()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(address)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._thread = threading.Thread(target=self._loop, name="engine-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish(self, outputs: list[Output]) -> None:
        """Send outputs to their workers; callable from any thread."""
        if not outputs:
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.connect(self._inproc)
        push.send_multipart([protocol.encode(o) for o in outputs])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._router in events:
                self._drain_requests()
            if self._pull in events:
                self._drain_outputs()
        self._drain_outputs()  # what the engine published last (errors before an exit) still goes out
        self._router.close()
        self._pull.close()

    def _drain_requests(self) -> None:
        while True:
            try:
                identity, payload = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode_to_engine(payload)
            except Exception as exc:  # a malformed frame must not kill the engine
                log.error("dropping undecodable message: %s", exc)
                continue
            if isinstance(msg, Health):
                reply = self._health()
                self._router.send_multipart([identity, protocol.encode(
                    msgspec.structs.replace(reply, nonce=msg.nonce))])
                continue
            if isinstance(msg, Add):
                self._owners[msg.request_id] = identity
            self._on_message(msg)

    def _drain_outputs(self) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for frame in frames:
                out = protocol.decode_from_engine(frame)
                identity = self._owners.get(out.request_id)
                if identity is None:
                    continue  # aborted / unknown: nobody is waiting
                if out.finished:
                    del self._owners[out.request_id]
                self._router.send_multipart([identity, frame])
