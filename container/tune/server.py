"""`lmi tune`'s trials: each candidate served by a real `lmi serve` process on a free port, driven
by the load, then stopped (SIGTERM, as an orchestrator would; whatever outlives it is killed by
process id, its own descendants only)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from container.tune.load import LoadShape, measure
from container.tune.search import Budget, Trial
from container.tune.space import Candidate

PING_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 30.0


class StartFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_properties(path: str, props: Mapping[str, str], header: str = "") -> None:
    """Java properties, one `key=value` a line (escaped as container/properties.py reads them back);
    `#` lines for the header."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{_escape(k, is_key=True)}={_escape(v)}" for k, v in props.items()]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f"}


def _escape(text: str, is_key: bool = False) -> str:
    """A base file's value may hold backslashes or line breaks (an inline chat template); a key ends at
    `=`, `:` or white space. (White space around a value is trimmed on reading, escaped or not.)"""
    return "".join(_ESCAPES.get(c, "\\" + c if is_key and c in "=: #!" else c) for c in text)


class ServerProcess:
    """`python -m container.cli serve --properties F --model-dir M` on 127.0.0.1 and a free port."""

    def __init__(self, props: Mapping[str, str], model_dir: str, workdir: str, name: str,
                 env: Mapping[str, str] | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port()
        self.properties_path = os.path.join(workdir, f"{name}.properties")
        self.log_path = os.path.join(workdir, f"{name}.log")
        write_properties(self.properties_path, props)
        cmd = [sys.executable, "-m", "container.cli", "serve", "--properties", self.properties_path,
               "--model-dir", model_dir, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env or os.environ),
                                         start_new_session=True)
        self.children: set[int] = set()
        self.copies = int(props.get("maxWorkers", props.get("minWorkers", 1)))

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /ping answers 200 and every model copy is ready (/ping turns healthy with the
        first); StartFailure when the server exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._get("/ping")[0] == 200 and self._ready_copies() >= self.copies:
                self.children = _descendants(self.proc.pid)
                return
            try:  # the pause between pings, cut short if the server exits
                self.proc.wait(timeout=PING_INTERVAL_S)
                raise StartFailure(f"the server exited with {self.proc.returncode}: {self.last_error()}")
            except subprocess.TimeoutExpired:
                pass
        raise StartFailure(f"not ready in {timeout_s:.0f} s: {self.last_error()}")

    def _get(self, path: str) -> tuple[int | None, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            return None, ""
        finally:
            conn.close()

    def _ready_copies(self) -> int:
        if self.copies == 1:
            return 1
        text = self._get("/metrics")[1]
        return sum(1 for line in text.splitlines() if line.startswith("lmi_engine_ready") and line.endswith(" 1.0"))

    def last_error(self) -> str:
        """The log's last error line (or its last line): why a start failed, in one line."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return "no log"
        errors = [line for line in lines if " ERROR " in line or "error:" in line]
        return (errors or lines or ["empty log"])[-1][-300:]

    def stop(self) -> None:
        self.children |= _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.children:  # an engine or worker the launcher did not take down
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _descendants(pid: int) -> set[int]:
    """Process ids below `pid`, from /proc (Linux; empty elsewhere)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent and p not in found]
        found.update(kids)
        todo += kids
    return found


@dataclass
class Evaluator:
    """One trial: start the candidate's server, drive the load (warm-up, window, drain), stop it."""

    base: Mapping[str, str]
    model_dir: str
    bodies: list[dict]
    load: LoadShape
    workdir: str
    budget: Budget  # a start may take no longer than what is left
    env: Mapping[str, str] | None = None
    on_phase: Callable[[str], None] = lambda text: None
    clock: Callable[[], float] = time.monotonic

    def __call__(self, cand: Candidate, window_s: float, rung: int) -> Trial:
        started = self.clock()
        trial = Trial(cand.name, cand.properties, rung, window_s)
        self.on_phase(f"rung {rung}: starting {cand.name}")
        server = self.start(cand, f"rung{rung}-{_slug(cand.name)}")
        try:
            server.wait_ready(max(self.budget.remaining(), 1.0))
            self.on_phase(f"rung {rung}: measuring {cand.name} ({window_s:.0f} s)")
            trial.measurement, error = measure("127.0.0.1", server.port, self.bodies, self.load, window_s, self.clock)
            trial.failure = error
        except StartFailure as exc:
            trial.failure = str(exc)
        finally:
            server.stop()
        trial.cost_s = self.clock() - started
        return trial

    def start(self, cand: Candidate, name: str) -> ServerProcess:
        return ServerProcess({**self.base, **cand.properties}, self.model_dir, self.workdir, name, self.env)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "=-_." else "_" for c in name)[:80]
