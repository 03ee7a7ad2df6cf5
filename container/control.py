"""The launcher's management socket (run_dir/control.sock): the HTTP workers' ModelCommands
(engines/process/models.py) answered by the Registry, each in a thread of its own, so that a model
loading for minutes does not hold up a listing or another model's unload.

    worker REQ ──[command]──► ROUTER (this thread) ──► handler thread: registry op ──► reply queue
    worker REQ ◄──[reply]─── ROUTER ◄────────────────────────────────────────────────┘
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import msgspec
import zmq

from container.registration import Refusal
from engines.process.models import ModelCommand, ModelReply, control_socket_path

log = logging.getLogger("container.launcher")

POLL_MS = 50


class ControlServer:
    def __init__(self, run_dir: str, handle: Callable[[ModelCommand], ModelReply]):
        self.handle = handle
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(control_socket_path(run_dir))
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=1.0)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            if self._sock.poll(POLL_MS):
                frames = self._sock.recv_multipart()
                threading.Thread(target=self._answer, args=(frames[0], frames[-1]), daemon=True).start()
            while True:
                try:
                    ident, reply = self._replies.get_nowait()
                except queue.Empty:
                    break
                self._sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])
        self._sock.close()

    def _answer(self, ident: bytes, payload: bytes) -> None:
        try:
            command = msgspec.msgpack.decode(payload, type=ModelCommand)
            reply = self.handle(command)
        except Refusal as exc:
            reply = ModelReply(exc.code, exc.message)
        except Exception as exc:  # a management call never takes the launcher down: said, and answered
            log.exception("management command failed")
            reply = ModelReply(500, f"the management command failed: {type(exc).__name__}: {exc}")
        self._replies.put((ident, reply))

