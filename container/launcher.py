"""Start the engine group and gunicorn, then supervise them.

    launcher ──► engine      python -m engines.process.serve --run-dir D     (engine=MPI: under mpirun)
             └─► gunicorn    handlers.app:create_app(D), threaded workers
    cannot start           → preflight (model files, tokenizer, weights, mpirun, port): one line, exit 2
    engine dies            → stop gunicorn, exit non-zero; with several model copies (maxWorkers), a copy
                             that dies after it served is restarted and the others go on
    gunicorn dies          → stop the engine, exit non-zero
    SIGTERM / SIGINT       → drain: the workers answer 503 to new requests (and /ping), requests in
                             flight get drain_timeout seconds to finish and are then aborted with a
                             503; once the engine is idle (or the time is up) gunicorn and the
                             engine stop; exit 0. The default budget fits SageMaker's 30 s.
    not ready in time      → option.model_loading_timeout: stop both, exit non-zero

Every child runs in its own session so that a whole group (mpirun and its ranks) can be signalled.
When the server stops because something failed, the last log line says what, in one sentence.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from container.preflight import first_problem
from engines.config import LmiConfig
from engines.process.startup import TIMELINE, startup_path
from engines.process.rundir import (CORES_ENV, DIST_PORT, copy_dirs, draining_path, engine_socket_path, failure_path,
                                    read_failure, ready_path, write_atomically, write_failure)

log = logging.getLogger("container.launcher")

POLL_S = 0.2
DRAIN_POLL_S = 0.05  # a drain with nothing in flight ends after two idle polls: 0.1 s
STOP_GRACE_S = 10.0
DEAD_LINGER_S = 1.5  # after the engine died: /ping says 503 and in-flight requests get 424, then exit


def engine_command(config: LmiConfig, run_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "engines.process.serve", "--run-dir", run_dir]
    par = config.parallel
    if par.use_mpi and par.ranks > 1:  # one rank needs no mpirun
        n = str(par.ranks)
        hosts: list[str] = []
        if par.hostfile:  # multi-node: the ranks over the hostfile's hosts, over TCP (docs/multinode.md)
            hosts = ["--hostfile", par.hostfile, "--mca", "orte_keep_fqdn_hostnames", "t",
                     *[a for var in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "HOME", "MASTER_ADDR", "MASTER_PORT")
                       for a in ("-x", var)]]
        if par.rsh_agent:
            hosts += ["--mca", "plm_rsh_agent", par.rsh_agent]
        if par.network:
            hosts += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", par.network,
                      "--mca", "oob_tcp_if_include", par.network]
        cmd = ["mpirun", "--allow-run-as-root", "--bind-to", "none", *hosts, "-np", n, *cmd]
    return cmd


def first_host(hostfile: str) -> str:
    """An Open MPI hostfile's first host (where rank 0 runs)."""
    with open(hostfile, encoding="utf-8") as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                return words[0]
    raise ValueError(f"option.mpi_hostfile={hostfile} lists no host")


def gunicorn_command(config: LmiConfig, run_dir: str, host: str) -> list[str]:
    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gunicorn_conf.py")
    server = config.server
    return [sys.executable, "-m", "gunicorn", "-c", conf, "--bind", f"{host}:{server.port}",
            "--workers", str(server.http_workers), "--threads", str(server.http_threads),
            "--graceful-timeout", str(int(server.drain_timeout_s + STOP_GRACE_S)),
            f"handlers.app:create_app({run_dir!r})"]


MALLOC_ARENA_MAX = "2"


class Launcher:
    def __init__(self, config: LmiConfig, *, host: str = "0.0.0.0", env: dict[str, str] | None = None):
        self.config = config
        self.host = host
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        # glibc gives each busy thread its own malloc arena (up to 8 per core), each keeping its own
        # high-water mark: two bound the RSS of our threaded processes (unless the user set it)
        self.env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
        self.run_dir = tempfile.mkdtemp(prefix="lmi-run-")
        self._stopping = False
        self._signalled = threading.Event()  # wakes the supervision loop's wait at once on SIGTERM / SIGINT
        self.ready = False
        self.failure: str | None = None  # why the server stopped, when something failed

    def run(self) -> int:
        problem = first_problem(self.config, self.host, self.env)
        if problem:
            log.error("lmi-serve did not start: %s", problem)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return 2
        copies = [EngineCopy(i, d, self.config) for i, d in enumerate(copy_dirs(self.run_dir,
                                                                               self.config.parallel.copies))]
        for directory in {self.run_dir, *(c.dir for c in copies)}:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "config.json"), "wb") as f:
                f.write(self.config.to_json())
            TIMELINE.write(startup_path(directory))  # the launcher's phases, for the engine to carry on
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for c in copies:
            c.proc = self._spawn("engine" if len(copies) == 1 else f"engine copy {c.index}", c.command(),
                                 c.environment(self.env))
        http = self._spawn("gunicorn", gunicorn_command(self.config, self.run_dir, self.host))
        try:
            return self._supervise(copies, http)
        finally:
            for proc in (http, *(c.proc for c in copies)):
                _stop_all([proc], STOP_GRACE_S)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.failure:  # the last line of the log: after the children's own last words
                log.error("lmi-serve %s: %s", "stopped" if self.ready else "did not start", self.failure)

    def _on_signal(self, signum, _frame) -> None:
        if not self._stopping:
            log.info("received %s: draining", signal.Signals(signum).name)
        self._stopping = True
        self._signalled.set()

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log.info("starting %s: %s", name, " ".join(cmd))
        return subprocess.Popen(cmd, env=env or self.env, start_new_session=True)

    def _supervise(self, copies: list["EngineCopy"], http: subprocess.Popen) -> int:
        """One copy: its death stops the server (SageMaker replaces the container). Several: a copy that
        dies after it served is restarted while the others go on; one that never got ready stops the server."""
        while True:
            if self._stopping:
                return self._drain(copies, http)
            for c in copies:
                if c.restart_at is not None:
                    if time.monotonic() >= c.restart_at:
                        c.clear()
                        c.proc = self._spawn(f"engine copy {c.index} again", c.command(), c.environment(self.env))
                    continue
                if c.proc.poll() is None and c.ready and read_failure(c.dir, "engine") is not None:
                    # the engine said it is dead and its group lingers: mpirun can hang aborting a job
                    # with a rank it cannot reach (tests/test_multinode.py saw it): end the group
                    c.failed_at = c.failed_at or time.monotonic()
                    if time.monotonic() - c.failed_at > DEAD_LINGER_S:
                        log.error("the engine reported a failure and its process group did not exit: killing it")
                        _signal_group(c.proc, signal.SIGKILL)
                        c.proc.wait()
                if c.proc.poll() is not None:
                    c.ready = c.ready or os.path.exists(ready_path(c.dir))
                    reason = read_failure(c.dir, "engine") or f"the engine exited with code {c.proc.returncode}"
                    if len(copies) == 1 or not c.ready:
                        self.ready = self.ready or c.ready
                        self.failure = reason if len(copies) == 1 else f"model copy {c.index}: {reason}"
                        log.error("%s: stopping the server", self.failure)
                        self._mark_dead(copies, self.failure)
                        return c.proc.returncode or 1
                    log.error("model copy %d died (%s): restarting it; the other copies go on serving", c.index,
                              reason)
                    if read_failure(c.dir, "engine") is None:  # its HTTP requests fail with 424 now
                        write_failure(c.dir, "engine", reason)
                    c.restarts += 1
                    c.ready, c.restart_at = False, time.monotonic() + DEAD_LINGER_S
                elif not c.ready:
                    c.ready = self._check_loading(c)
                    if self.failure:
                        return 1
            if http.poll() is not None:
                self.failure = read_failure(self.run_dir, "http") or f"gunicorn exited with code {http.returncode}"
                log.error("%s: stopping the engine", self.failure)
                return http.returncode or 1
            self._signalled.wait(POLL_S)

    def _check_loading(self, c: "EngineCopy") -> bool:
        if os.path.exists(ready_path(c.dir)):
            if not self.ready:
                port = self.config.server.port
                log.info("engine ready after %.1f s; try:\n  curl -s http://localhost:%d/invocations "
                         "-H 'Content-Type: application/json' "
                         "-d '{\"inputs\": \"The river ran\", \"parameters\": {\"max_new_tokens\": 20}}'",
                         time.monotonic() - c.started, port)
            elif c.restarts:
                log.info("model copy %d is back after %.1f s", c.index, time.monotonic() - c.started)
            self.ready = True
            return True
        limit = self.config.server.model_loading_timeout_s
        if time.monotonic() - c.started > limit:
            self.failure = f"the engine was not ready within option.model_loading_timeout={limit:.0f} s"
        return False

    def _mark_dead(self, copies: list["EngineCopy"], reason: str) -> None:
        """Tell the HTTP workers (503 on /ping, 424 for requests in flight) before they go down,
        unless the engine has said so itself."""
        for c in copies:
            if read_failure(c.dir, "engine") is None:
                write_failure(c.dir, "engine", reason)
        time.sleep(DEAD_LINGER_S)

    def _drain(self, copies: list["EngineCopy"], http: subprocess.Popen) -> int:
        """New requests get 503 from now on; those in flight finish, or are aborted at the deadline."""
        from handlers.engine_client import EngineClient

        probes = [EngineClient(engine_socket_path(c.dir)) for c in copies]
        budget = self.config.server.drain_timeout_s
        deadline = time.time() + budget
        write_atomically(draining_path(self.run_dir), repr(deadline))
        log.info("draining: new requests get 503; requests in flight have %g s to finish", budget)
        idle_in_a_row = 0
        while idle_in_a_row < 2 and time.time() < deadline + DRAIN_POLL_S and \
                any(c.proc.poll() is None for c in copies):
            replies = [p.health(timeout=POLL_S) if c.proc.poll() is None else None for p, c in zip(probes, copies)]
            idle = all(r is None and c.proc.poll() is not None or r is not None and r.num_running == 0 and
                       r.num_waiting == 0 for r, c in zip(replies, copies))
            idle_in_a_row = idle_in_a_row + 1 if idle else 0
            time.sleep(DRAIN_POLL_S)
        # gunicorn lets the responses still being written finish; a request still running at the
        # deadline is aborted by its worker with a 503, so the engines stop after it. Drained with
        # nothing in flight, nothing needs an engine any more: every process stops at once.
        if idle_in_a_row >= 2:
            _stop_all([http] + [c.proc for c in copies], STOP_GRACE_S)
        else:
            _stop_all([http], max(deadline - time.time(), 0) + STOP_GRACE_S)
            _stop_all([c.proc for c in copies], STOP_GRACE_S)
        log.info("stopped")
        return 0


class EngineCopy:
    """One model copy's engine group: its directory, its devices or cores, its process."""

    def __init__(self, index: int, directory: str, config: LmiConfig):
        self.index = index
        self.dir = directory
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.started = time.monotonic()
        self.restarts = 0
        self.restart_at: float | None = None
        self.failed_at: float | None = None  # when its failure file appeared while its process lived on

    def command(self) -> list[str]:
        self.started = time.monotonic()
        return engine_command(self.config, self.dir)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """Its GPUs (CUDA_VISIBLE_DEVICES) or cores (LMI_CPU_CORES, engines/process/serve.py pins to them), and
        torch.distributed's rendezvous (GPU ranks): a port of its own (MASTER_PORT + copy index) on rank 0's
        host (with a hostfile its first host, the leader)."""
        env = dict(base)
        par = self.config.parallel
        env["MASTER_PORT"] = str(int(base.get("MASTER_PORT") or DIST_PORT) + self.index)
        if par.hostfile:
            env["MASTER_ADDR"] = first_host(par.hostfile)
        if par.copy_devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(par.copy_devices[self.index])
        if par.copy_cores:
            env[CORES_ENV] = ",".join(str(c) for c in par.copy_cores[self.index])
            env["OMP_NUM_THREADS"] = str(max(1, len(par.copy_cores[self.index]) // par.ranks))
        return env

    def clear(self) -> None:
        """Before a restart: the last life's ready and failure files go."""
        for path in (ready_path(self.dir), failure_path(self.dir, "engine")):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        self.restart_at = self.failed_at = None


def _stop_all(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every child's session at once, then each waited for, at most `grace` seconds in all,
    then killed with its session's leftovers (ranks, workers)."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0f s: killing it", proc.pid, grace)
        _signal_group(proc, signal.SIGKILL)  # leftovers of the session (ranks, workers)
        proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
