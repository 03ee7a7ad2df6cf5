"""`lmi tune`'s load: a closed loop of N clients (or Poisson arrivals at a rate) streaming LMI
requests to a real server over HTTP (the standard library's http.client: the product ships no
HTTP client), measured in a window after a warm-up.

    |-- warm-up --|----------- window -----------|-- drain --|
     ^ clients    ^ requests started here count   ^ the load goes on, uncounted, until every
       ramp in    ^ tokens arriving here count      counted request has its first tokens

Throughput is the tokens that arrived inside the window over its length. TTFT and TPOT are those
of the requests started inside it (and of those still waiting for a first token when it began); the
drain lets them get their first tokens under the same load.
A request still without a first token when the drain ends has its TTFT counted as the time it
waited (a lower bound, so a p90 over the target is a true miss). Then every connection is shut,
which aborts its request in the server.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from container.tune.search import Measurement

TPOT_TOKENS = 8  # tokens a counted request needs before the drain may stop (what its TPOT is measured on)
ERROR_PAUSE_S = 0.5
MAX_OPEN_LOOP = 1024  # requests in flight at once with --rate; beyond it arrivals wait (the client saturates)


@dataclass(frozen=True)
class LoadShape:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # requests/s, Poisson arrivals
    warmup_s: float = 5.0
    max_drain_s: float = 15.0
    seed: int = 0


@dataclass
class Record:
    started: float
    max_new_tokens: int
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    in_window: int = 0
    done: bool = False
    error: str | None = None


@dataclass
class _Run:
    host: str
    port: int
    window_start: float
    window_end: float
    clock: Callable[[], float]
    records: list[Record] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)
    open_conns: set = field(default_factory=set)

    def send(self, body: dict) -> bool:
        """One request, recorded; whether it failed."""
        rec = Record(self.clock(), int(body["parameters"]["max_new_tokens"]))
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            with self.changed:  # connected under the lock: abort_all sees no connection, or one it can shut
                if self.stop.is_set():
                    return False
                self.records.append(rec)
                self.open_conns.add(conn)
                conn.connect()
            conn.request("POST", "/invocations", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return True
            self._read(resp, rec)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if not self.stop.is_set():  # after the stop, a shut connection is ours, not the server's
                rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self.changed:
                self.open_conns.discard(conn)
                self.changed.notify_all()
            conn.close()
        return rec.error is not None

    def _read(self, resp: http.client.HTTPResponse, rec: Record) -> None:
        while line := resp.readline():
            if not line.strip():
                continue
            obj = json.loads(line)
            if obj.get("token") is None:
                if "code" in obj or "error" in obj:
                    rec.error = f"stream error: {obj.get('error') or obj}"
                    return
                continue
            now = self.clock()
            with self.changed:
                rec.first = rec.first if rec.first is not None else now
                rec.last = now
                rec.num_tokens += 1
                rec.in_window += self.window_start <= now < self.window_end
                self.changed.notify_all()
        rec.done = True

    def counted(self) -> list[Record]:
        """The requests started in the window, and those started before it still waiting for their
        first token when it began: their wait is the window's too (a config that never answers shows)."""
        return [r for r in list(self.records) if self.window_start <= r.started < self.window_end
                or (r.started < self.window_start and (r.first is None or r.first >= self.window_start))]

    def settled(self) -> bool:
        """Every counted request finished, failed, or has the tokens its TPOT is measured on."""
        return all(r.done or r.error or r.num_tokens >= min(TPOT_TOKENS, r.max_new_tokens) for r in self.counted())

    def abort_all(self) -> None:
        self.stop.set()
        with self.changed:
            conns = list(self.open_conns)
        for conn in conns:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def measure(url_host: str, port: int, bodies: list[dict], shape: LoadShape, window_s: float,
            clock: Callable[[], float] = time.monotonic) -> tuple[Measurement, str | None]:
    """Drive the load for warm-up + window + drain: the window's summary and the first error seen."""
    started = clock()
    run = _Run(url_host, port, started + shape.warmup_s, started + shape.warmup_s + window_s, clock)
    threads = _start_closed(run, bodies, shape.concurrency, shape.warmup_s) if shape.concurrency else \
        [threading.Thread(target=_open_loop, args=(run, bodies, shape.rate, shape.seed), daemon=True)]
    if not shape.concurrency:
        threads[0].start()
    run.stop.wait(max(run.window_end - clock(), 0.0))  # the measured window (nothing sets stop before its end)
    with run.changed:
        run.changed.wait_for(run.settled, timeout=min(shape.max_drain_s, window_s))  # a bad config: no long drain
    ended = clock()
    run.abort_all()
    for t in threads:
        t.join(timeout=30)
    return summarise(run.counted(), run.records, window_s, ended), first_error(run.records)


def _start_closed(run: _Run, bodies: list[dict], concurrency: int, ramp_s: float) -> list[threading.Thread]:
    """The clients start spread over the warm-up (client i after i/N of it), so that the window sees
    requests at every stage rather than N in step, all prefilling at once."""
    def client(i: int) -> None:
        k = i
        run.stop.wait(ramp_s * i / concurrency)  # its place in the ramp: a schedule, not a wait for an event
        while not run.stop.is_set():
            if run.send(bodies[k % len(bodies)]):
                run.stop.wait(ERROR_PAUSE_S)  # a failing server: do not spin on refused connections
            k += concurrency

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    return threads


def _open_loop(run: _Run, bodies: list[dict], rate: float, seed: int) -> None:
    rng = random.Random(seed)
    slots = threading.BoundedSemaphore(MAX_OPEN_LOOP)
    k = 0

    def one(body: dict) -> None:
        try:
            run.send(body)
        finally:
            slots.release()

    while not run.stop.wait(rng.expovariate(rate)):  # the Poisson gap: a timed wait, ended early by the stop
        if not slots.acquire(timeout=1.0):
            continue
        threading.Thread(target=one, args=(bodies[k % len(bodies)],), daemon=True).start()
        k += 1


def summarise(counted: list[Record], every: list[Record], window_s: float, ended: float) -> Measurement:
    ttft = sorted((r.first if r.first is not None else ended) - r.started for r in counted if not r.error)
    tpot = sorted((r.last - r.first) / (r.num_tokens - 1) for r in counted if not r.error and r.num_tokens >= 2)
    return Measurement(throughput=sum(r.in_window for r in every) / window_s, ttft_p50=percentile(ttft, 50),
                       ttft_p90=percentile(ttft, 90), tpot_p90=percentile(tpot, 90), num_requests=len(counted),
                       errors=sum(1 for r in every if r.error), window_s=window_s,
                       num_censored=sum(1 for r in counted if r.first is None and not r.error))


def percentile(values: list[float], q: float) -> float:
    """Nearest rank on sorted values; nan for none."""
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def first_error(records: list[Record]) -> str | None:
    return next((r.error for r in records if r.error), None)
