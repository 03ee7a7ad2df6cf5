"""gunicorn's threaded worker, with health checks that generation traffic cannot starve.

A gthread worker hands every readable connection to one thread pool. Under load each of those
threads holds a generation request for seconds, and a `GET /ping` waits behind them: SageMaker gives
up after 2 s and replaces a healthy host. This worker looks at the first bytes of a connection
(MSG_PEEK: nothing is consumed) before choosing a pool; `/ping` and `/health` go to a small pool of
their own. A connection with nothing to read yet waits on the worker's poller, not in a pool thread,
and is classified once its request line arrives.

Built on gunicorn 27's gthread internals (`enqueue_req`, `pending_conns`, `_cap_keepalive`); pyproject
pins the series.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from gunicorn.workers.gthread import ThreadWorker

HEALTH_REQUESTS = (b"GET /ping", b"GET /health", b"HEAD /ping")
HEALTH_THREADS = 2


def peek(conn) -> bytes | None:
    """The first bytes a connection holds, unread; None when nothing has arrived yet."""
    parser = getattr(conn, "parser", None)
    if parser is not None:
        buffered = parser.unreader.buf.getvalue()
        if buffered:
            return buffered[:16]
    try:
        return conn.sock.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b""  # closed or broken: the pool thread will find out and close it


def is_health_check(head: bytes) -> bool:
    return any(head.startswith(prefix) for prefix in HEALTH_REQUESTS)


class HealthFirstWorker(ThreadWorker):
    def init_process(self):
        self.health_pool = ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="health")
        super().init_process()

    def enqueue_req(self, conn):
        head = peek(conn)
        if head is None and not conn.initialized and not conn.data_ready:
            self._wait_for_data(conn)
            return
        pool = self.health_pool if head and is_health_check(head) else self.tpool
        fs = pool.submit(self.handle, conn)
        fs.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    def _wait_for_data(self, conn) -> None:
        """As gthread does for a connection deferred by a pool thread, without taking one first."""
        conn.sock.setblocking(False)
        conn.timeout = time.monotonic() + self.cfg.keepalive
        self.pending_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_pending_socket_readable, conn))

    def handle_quit(self, sig, frame):
        self.health_pool.shutdown(wait=False)
        super().handle_quit(sig, frame)

    def _cap_keepalive(self, deadline):
        """At stop, idle kept-alive connections close at once, not after gunicorn's 2 s linger: the
        launcher stops the workers only after its drain (new requests answered 503, those in flight
        finished or aborted), so nothing is left to answer on them. A server's stop: 2.5 -> 1.1 s."""
        super()._cap_keepalive(time.monotonic())


class QuietPings(logging.Filter):
    """Access-log filter of each worker: a /ping or /health line is logged when its status differs
    from that route's previous one (ready, then unhealthy, ...), and otherwise only when the access
    logger is at DEBUG. Other requests pass."""

    ROUTES = ("/ping", "/health")

    def __init__(self):
        super().__init__()
        self._last: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        atoms = record.args if isinstance(record.args, dict) else {}
        path = atoms.get("U")
        if path not in self.ROUTES:
            return True
        status = str(atoms.get("s"))
        changed = self._last.get(path) != status
        self._last[path] = status
        return changed or logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
