"""The engine's ZeroMQ side: one IO thread owns the ROUTER socket.

It answers HEALTH at once (also while the model is still loading) from the snapshot the engine
keeps, hands ADD/ABORT/ADAPTER_COMMAND to the engine, and sends the engine's outputs and replies back
to the worker socket each request came from. The engine thread publishes through an inproc PUSH socket, so no ZeroMQ socket
is ever used by two threads. Nothing is dropped: outputs wait in an outbox while a worker's queue
is full (engines/process/ipc.py); only outputs for a worker that is gone are discarded, and their request
is aborted so the engine stops working for nobody.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import msgspec
import zmq

from engines import protocol
from engines.process import ipc
from engines.protocol import Abort, AdapterCommand, Add, Health, HealthReply, Output

log = logging.getLogger(__name__)
FINAL_LINGER_MS = 1000  # how long the last outputs may take to leave after close (deliver_before_exit)


class EngineEndpoint:
    def __init__(self, address: str, on_message: Callable[[Add | Abort | AdapterCommand], None],
                 health: Callable[[], HealthReply], hwm: int = ipc.high_water_mark(1000, 32)):
        self._address = address
        self._on_message = on_message
        self._health = health
        self._ctx = zmq.Context.instance()
        self._inproc = f"inproc://engine-outputs-{id(self)}"
        self._owners: dict[str, bytes] = {}  # request id -> worker socket identity, while it runs
        self._stop = threading.Event()
        self._local = threading.local()
        self._router = ipc.configure(self._ctx.socket(zmq.ROUTER), hwm)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer raises EAGAIN instead of dropping
        self._router.bind(address)
        self._outbox = ipc.Outbox(self._router, self._unroutable)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self._inproc)
        self._thread = threading.Thread(target=self._loop, name="engine-io", daemon=True)

    @property
    def num_owners(self) -> int:
        return len(self._owners)

    def start(self) -> None:
        self._thread.start()

    def publish(self, outputs: list[Output]) -> None:
        """Send outputs to their workers; callable from any thread."""
        if not outputs:
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(self._inproc)
        push.send_multipart([protocol.encode(o) for o in outputs])

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout)

    def deliver_before_exit(self, timeout: float = 1.0) -> None:
        """Before os._exit: ZeroMQ's IO thread sends what the closed ROUTER still holds (the failed
        requests' errors), for up to `timeout`; an exit right after close() could drop them."""
        done = threading.Thread(target=self._ctx.destroy, kwargs={"linger": int(timeout * 1000)}, daemon=True)
        done.start()
        done.join(timeout + 0.5)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(self._outbox.poll_timeout_ms()))
            if self._router in events:
                ipc.drain(self._router, self._on_request)
            if self._pull in events:
                ipc.drain(self._pull, self._route_outputs)
            self._outbox.flush()
        # what the engine published last (errors before an exit) still goes out
        ipc.drain(self._pull, self._route_outputs)
        self._outbox.flush()
        self._router.close(linger=FINAL_LINGER_MS)  # sockets linger 0 (ipc.configure): these must still go
        self._pull.close()

    def _on_request(self, frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[-1]
        try:
            msg = protocol.decode_to_engine(payload)
        except Exception as exc:  # a malformed frame must not kill the engine
            log.error("dropping undecodable message: %s", exc)
            return
        if isinstance(msg, Health):
            reply = msgspec.structs.replace(self._health(), nonce=msg.nonce)
            self._outbox.put([identity, protocol.encode(reply)])
            return
        if isinstance(msg, Abort):  # nobody waits for its outputs any more
            self._owners.pop(msg.request_id, None)
        else:  # a request (Add, Encode) or a command: its outputs or reply go back to this worker
            self._owners[msg.request_id] = identity
        self._on_message(msg)

    def _route_outputs(self, frames: list[bytes]) -> None:
        for frame in frames:
            out = protocol.decode_from_engine(frame)
            identity = self._owners.get(out.request_id)
            if identity is None:
                continue  # aborted: nobody is waiting
            if not isinstance(out, Output) or out.finished:  # (a reply: AdapterReply, HandlerReply, Encoded)
                del self._owners[out.request_id]
            self._outbox.put([identity, frame])

    def _unroutable(self, frames: list[bytes]) -> None:
        """The worker that sent a request is gone (its process died): stop generating for it."""
        msg = protocol.decode_from_engine(frames[-1])
        if isinstance(msg, Output):
            log.warning("[%s] its HTTP worker is gone: request aborted", msg.request_id)
            self._owners.pop(msg.request_id, None)
            if not msg.finished:
                self._on_message(Abort(msg.request_id))
