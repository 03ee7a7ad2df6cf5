"""Start the engine group and gunicorn, then supervise them.

    launcher ──► engine      python -m engines.serve --run-dir D     (engine=MPI: under mpirun)
             └─► gunicorn    handlers.app:create_app(D), threaded workers
    engine dies            → stop gunicorn, exit non-zero
    gunicorn dies          → stop the engine, exit non-zero
    SIGTERM / SIGINT       → gunicorn drains (stops accepting, finishes in-flight requests),
                             then the engine stops; exit 0
    not ready in time      → option.model_loading_timeout: stop both, exit non-zero

Every child runs in its own session so that a whole group (mpirun and its ranks) can be signalled.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from engines.config import LmiConfig
from engines.protocol import STATE_DEAD, STATE_READY, engine_dead_path, engine_socket_path

log = logging.getLogger("container.launcher")

POLL_S = 0.2
STOP_GRACE_S = 10.0
DEAD_LINGER_S = 1.5  # after the engine died: /ping says 503 and in-flight requests get 424, then exit


def engine_command(config: LmiConfig, run_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "engines.serve", "--run-dir", run_dir]
    if config.parallel.use_mpi and config.parallel.tensor_parallel_degree > 1:  # one rank needs no mpirun
        n = str(config.parallel.tensor_parallel_degree)
        cmd = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "-np", n, *cmd]
    return cmd


def gunicorn_command(config: LmiConfig, run_dir: str, host: str) -> list[str]:
    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gunicorn_conf.py")
    server = config.server
    return [sys.executable, "-m", "gunicorn", "-c", conf, "--bind", f"{host}:{server.port}",
            "--workers", str(server.http_workers), "--threads", str(server.http_threads),
            "--graceful-timeout", str(int(config.scheduler.predict_timeout_s)),
            f"handlers.app:create_app({run_dir!r})"]


class Launcher:
    def __init__(self, config: LmiConfig, *, host: str = "0.0.0.0", env: dict[str, str] | None = None):
        self.config = config
        self.host = host
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.run_dir = tempfile.mkdtemp(prefix="lmi-run-")
        self._stopping = False

    def run(self) -> int:
        with open(os.path.join(self.run_dir, "config.json"), "wb") as f:
            f.write(self.config.to_json())
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        engine = self._spawn("engine", engine_command(self.config, self.run_dir))
        http = self._spawn("gunicorn", gunicorn_command(self.config, self.run_dir, self.host))
        try:
            return self._supervise(engine, http)
        finally:
            for proc in (http, engine):
                _stop(proc, signal.SIGTERM, STOP_GRACE_S)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_signal(self, signum, _frame) -> None:
        if not self._stopping:
            log.info("received %s: draining", signal.Signals(signum).name)
        self._stopping = True

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log.info("starting %s: %s", name, " ".join(cmd))
        return subprocess.Popen(cmd, env=self.env, start_new_session=True)

    def _supervise(self, engine: subprocess.Popen, http: subprocess.Popen) -> int:
        from handlers.engine_client import EngineClient

        probe = EngineClient(engine_socket_path(self.run_dir))
        started = time.monotonic()
        ready = False
        while True:
            if self._stopping:
                return self._drain(engine, http)
            if engine.poll() is not None:
                reason = f"the engine exited with code {engine.returncode}"
                log.error("%s: stopping the server", reason)
                self._mark_dead(reason)
                return engine.returncode or 1
            if http.poll() is not None:
                log.error("gunicorn exited with code %s: stopping the engine", http.returncode)
                return http.returncode or 1
            if not ready:
                ready = self._check_loading(probe, started)
                if ready is None:
                    return 1
            time.sleep(POLL_S)

    def _check_loading(self, probe, started: float) -> bool | None:
        reply = probe.health(timeout=POLL_S)
        if reply is not None and reply.state == STATE_READY:
            port = self.config.server.port
            log.info("engine ready after %.1f s; try:\n  curl -s http://localhost:%d/invocations "
                     "-H 'Content-Type: application/json' "
                     "-d '{\"inputs\": \"The river ran\", \"parameters\": {\"max_new_tokens\": 20}}'",
                     time.monotonic() - started, port)
            return True
        if reply is not None and reply.state == STATE_DEAD:
            log.error("%s", reply.detail or "the engine failed to load")
            return None
        limit = self.config.server.model_loading_timeout_s
        if time.monotonic() - started > limit:
            log.error("the engine was not ready within option.model_loading_timeout=%.0f s", limit)
            return None
        return False

    def _mark_dead(self, reason: str) -> None:
        """Tell the HTTP workers (503 on /ping, 424 for requests in flight) before they go down."""
        with open(engine_dead_path(self.run_dir), "w") as f:
            f.write(reason)
        time.sleep(DEAD_LINGER_S)

    def _drain(self, engine: subprocess.Popen, http: subprocess.Popen) -> int:
        grace = self.config.scheduler.predict_timeout_s + STOP_GRACE_S
        _stop(http, signal.SIGTERM, grace)
        _stop(engine, signal.SIGTERM, STOP_GRACE_S)
        log.info("stopped")
        return 0


def _stop(proc: subprocess.Popen, sig: int, grace: float) -> None:
    """Signal a child's whole session, wait up to `grace` seconds, then kill it."""
    if proc.poll() is None:
        _signal_group(proc, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0f s: killing it", proc.pid, grace)
    _signal_group(proc, signal.SIGKILL)  # leftovers of the session (ranks, workers)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
