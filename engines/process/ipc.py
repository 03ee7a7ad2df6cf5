"""ZeroMQ plumbing both ends of the worker ↔ engine link share: sized sockets and an outbox that
never drops a frame.

A ZeroMQ socket refuses a send (EAGAIN) when the peer's queue reaches its high-water mark; a
ROUTER without ROUTER_MANDATORY even drops the message without a word. Neither is acceptable
between the HTTP workers and the engine: a lost ADD or OUTPUT leaves a client waiting until its
deadline. So every send goes through an `Outbox`: frames the socket cannot take now wait, in order,
and the IO thread retries them on its next turn (it polls with a short timeout while anything is
waiting). Memory is the only thing that grows under back-pressure, and it is bounded by the
requests in flight (job_queue_size) and their tokens.
"""

from __future__ import annotations

import collections
import errno
import logging
from typing import Callable

import zmq

log = logging.getLogger(__name__)

RETRY_POLL_MS = 5  # poll timeout of an IO thread while its outbox holds frames
IDLE_POLL_MS = 100


def high_water_mark(job_queue_size: int, max_num_seqs: int) -> int:
    """Messages a socket queues per peer before it pushes back: every request the engine may hold
    (waiting + running) with a few outputs each, so that back-pressure is the exception."""
    return 4 * (job_queue_size + max_num_seqs) + 1000


def configure(sock: zmq.Socket, hwm: int) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class Outbox:
    """Multipart messages waiting for `sock`; `flush` sends what it can, in order, and keeps the rest.

    `on_unroutable(frames)` is called (ROUTER_MANDATORY sockets) for a message whose peer is gone:
    that is the one case where a message is discarded, because nobody can receive it.
    """

    def __init__(self, sock: zmq.Socket, on_unroutable: Callable[[list[bytes]], None] | None = None):
        self.sock = sock
        self.on_unroutable = on_unroutable
        self.pending: collections.deque[list[bytes]] = collections.deque()

    def __len__(self) -> int:
        return len(self.pending)

    def put(self, frames: list[bytes]) -> None:
        self.pending.append(frames)

    def flush(self) -> None:
        while self.pending:
            frames = self.pending[0]
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                return  # the peer's queue is full: retry on the next turn
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH or self.on_unroutable is None:
                    raise
                self.on_unroutable(frames)
            self.pending.popleft()

    def poll_timeout_ms(self) -> int:
        return RETRY_POLL_MS if self.pending else IDLE_POLL_MS


def drain(sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
    """Receive every message `sock` holds now."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(frames)
