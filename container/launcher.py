"""Start the engine group and gunicorn, then supervise them.

    launcher ──► engine      python -m engines.process.serve --run-dir D     (engine=MPI: under mpirun)
             └─► gunicorn    handlers.app:create_app(D), threaded workers
    cannot start           → preflight (model files, tokenizer, weights, mpirun, port): one line, exit 2
    engine dies            → stop gunicorn, exit non-zero; with several model copies (maxWorkers), a copy
                             that dies after it served is restarted and the others go on; with several
                             models (docs/multi-model.md) a model that dies after it served is restarted
    POST /models ...       → the HTTP workers ask over run_dir/control.sock; container/registry.py loads,
                             unloads and places models, and publishes run_dir/models.json
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

import msgspec
from dataclasses import dataclass

from container import registration
from container.control import ControlServer
from container.model_group import DEAD_LINGER_S, EngineCopy, engine_command, stop_all, wait_idle  # noqa: F401
from container.preflight import check_port, first_problem
from container.registry import Registry, Settings
from engines.config import LmiConfig, ServerConfig
from engines.process.models import ModelCommand, ModelReply
from engines.process.rundir import draining_path, read_failure, write_atomically
from engines.process.startup import TIMELINE, startup_path

log = logging.getLogger("container.launcher")

POLL_S = 0.2
DRAIN_POLL_S = 0.05  # a drain with nothing in flight ends after two idle polls: 0.1 s
STOP_GRACE_S = 10.0


def gunicorn_command(server: ServerConfig, run_dir: str, host: str) -> list[str]:
    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gunicorn_conf.py")
    return [sys.executable, "-m", "gunicorn", "-c", conf, "--bind", f"{host}:{server.port}",
            "--workers", str(server.http_workers), "--threads", str(server.http_threads),
            "--graceful-timeout", str(int(server.drain_timeout_s + STOP_GRACE_S)),
            f"handlers.app:create_app({run_dir!r})"]


MALLOC_ARENA_MAX = "2"


@dataclass(frozen=True)
class Container:
    """What the server as a whole runs with, beside its models (docs/multi-model.md)."""
    server: ServerConfig  # the port, HTTP workers, body limits, drain (the startup model's, else the defaults')
    multi_model: bool = False
    url_pattern: str = r"^(file://)?/opt/ml/models?/"
    allow_custom_code: bool = False
    max_models_memory: str | None = None
    download_dir: str = ""
    startup_url: str = ""  # where the model it started with came from
    startup_need_bytes: int = 0


class Launcher:
    def __init__(self, config: LmiConfig | None, *, host: str = "0.0.0.0", env: dict[str, str] | None = None,
                 container: Container | None = None):
        self.config = config  # the model the server starts with (None: SageMaker multi-model mode, no model yet)
        self.container = container or Container(config.server)
        self.host = host
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        # glibc gives each busy thread its own malloc arena (up to 8 per core), each keeping its own
        # high-water mark: two bound the RSS of our threaded processes (unless the user set it)
        self.env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
        self.run_dir = tempfile.mkdtemp(prefix="lmi-run-")
        self._stopping = False
        self._signalled = threading.Event()  # wakes the supervision loop's wait at once on SIGTERM / SIGINT
        self.ready = False
        self.started = time.monotonic()
        self.failure: str | None = None  # why the server stopped, when something failed
        self.registry: Registry | None = None

    def run(self) -> int:
        problem = first_problem(self.config, self.host, self.env) if self.config else \
            check_port(self.host, self.container.server.port)
        if problem:
            log.error("lmi-serve did not start: %s", problem)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return 2
        self.registry = registry = Registry(self.run_dir, self._settings(), self._spawn, self.env)
        with open(os.path.join(self.run_dir, "server.json"), "wb") as f:
            f.write(msgspec.json.encode(self.container.server))
        group = None
        if self.config is not None:
            group = registry.add_startup(self.config.server.served_model_name, self.container.startup_url or
                                         self.config.model.local_dir, self.config, self.container.startup_need_bytes)
            for directory in {self.run_dir, *(c.dir for c in group.copies)}:
                TIMELINE.write(startup_path(directory))  # the launcher's phases, for the engine to carry on
        registry.publish()
        control = ControlServer(self.run_dir, self._command)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if group is not None:
            group.start(self._spawn, self.env)
        http = self._spawn("gunicorn", gunicorn_command(self.container.server, self.run_dir, self.host))
        try:
            return self._supervise(http)
        finally:
            control.close()
            stop_all([http], STOP_GRACE_S)
            registry.stop_all(STOP_GRACE_S)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.failure:  # the last line of the log: after the children's own last words
                log.error("lmi-serve %s: %s", "stopped" if self.ready else "did not start", self.failure)

    def _settings(self) -> Settings:
        from container.placement import count_gpus, gpu_memory_bytes
        from engines.config import memory_bytes
        from engines.weights.memory_plan import available_ram

        num_gpus = count_gpus(self.env)
        device_bytes = gpu_memory_bytes(num_gpus)
        machine = num_gpus * device_bytes if num_gpus else available_ram()
        spec = self.container.max_models_memory
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        visible = [d.strip() for d in self.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return Settings(budget_bytes=memory_bytes(spec, machine) if spec else machine, device_bytes=device_bytes,
                        num_gpus=num_gpus, cores=tuple(cores), multi_model=self.container.multi_model,
                        gpu_ids=tuple(visible or (str(i) for i in range(num_gpus))))

    def _command(self, cmd: ModelCommand) -> ModelReply:
        """A management call from an HTTP worker (container/control.py runs each in a thread)."""
        registry, c = self.registry, self.container
        if self._stopping:
            return ModelReply(503, "the server is shutting down")
        if cmd.op == "register":
            name = registration.check_name(cmd.name or registration.name_of(cmd.url))
            if name in registry.entries:
                return ModelReply(409, f"Model {name} is already registered.")
            s = registry.settings
            reg = registration.register(name, cmd.url, dict(cmd.options), url_pattern=c.url_pattern,
                                        allow_custom_code=c.allow_custom_code, download_dir=c.download_dir,
                                        num_gpus=s.num_gpus, num_cpus=len(s.cores), port=c.server.port,
                                        device_bytes=s.device_bytes)
            return ModelReply(*registry.register(reg, cmd.synchronous))
        if cmd.op == "unregister":
            return ModelReply(200, registry.unregister(cmd.name))
        if cmd.op == "load":
            registry.load(cmd.name)
            return ModelReply(200, {})
        if cmd.op == "scale":
            return ModelReply(200, registry.scale(cmd.name, int(cmd.options["copies"])))
        return ModelReply(400, f"unknown management command {cmd.op!r}")

    def _on_signal(self, signum, _frame) -> None:
        if not self._stopping:
            log.info("received %s: draining", signal.Signals(signum).name)
        self._stopping = True
        self._signalled.set()

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log.info("starting %s: %s", name, " ".join(cmd))
        return subprocess.Popen(cmd, env=env or self.env, start_new_session=True)

    def _supervise(self, http: subprocess.Popen) -> int:
        """One model: its death stops the server (SageMaker replaces the container), and so does a copy that
        never got ready; several copies or several models: one that dies after it served is restarted."""
        registry = self.registry
        while True:
            if self._stopping:
                return self._drain(http)
            reason = registry.check()
            if reason:
                startup = registry.entries[self.config.server.served_model_name].group
                self.ready = self.ready or any(c.ready for c in startup.copies)
                self.failure = reason
                log.error("%s: stopping the server", reason)
                startup.mark_dead(reason)
                time.sleep(DEAD_LINGER_S)
                return next((p.returncode for p in startup.procs if p.poll()), 1)
            self._log_ready()
            if http.poll() is not None:
                self.failure = read_failure(self.run_dir, "http") or f"gunicorn exited with code {http.returncode}"
                log.error("%s: stopping the engine", self.failure)
                return http.returncode or 1
            self._signalled.wait(POLL_S)

    def _log_ready(self) -> None:
        if self.ready:
            return
        group = self.registry.entries[self.config.server.served_model_name].group if self.config else None
        if group is not None and not any(c.ready for c in group.copies):
            return
        self.ready = True
        port = self.container.server.port
        if group is None:
            log.info("serving no model yet (multi-model mode): register one with\n  curl -s -X POST "
                     "'http://localhost:%d/models?model_name=NAME&url=/opt/ml/models/NAME/model'", port)
            return
        log.info("engine ready after %.1f s; try:\n  curl -s http://localhost:%d/invocations "
                 "-H 'Content-Type: application/json' "
                 "-d '{\"inputs\": \"The river ran\", \"parameters\": {\"max_new_tokens\": 20}}'",
                 time.monotonic() - self.started, port)

    def _drain(self, http: subprocess.Popen) -> int:
        """New requests get 503 from now on; those in flight finish, or are aborted at the deadline."""
        copies = [c for g in self.registry.groups() for c in g.copies if c.proc is not None]
        budget = self.container.server.drain_timeout_s
        deadline = time.time() + budget
        write_atomically(draining_path(self.run_dir), repr(deadline))
        log.info("draining: new requests get 503; requests in flight have %g s to finish", budget)
        # gunicorn lets the responses still being written finish; a request still running at the
        # deadline is aborted by its worker with a 503, so the engines stop after it. Drained with
        # nothing in flight, nothing needs an engine any more: every process stops at once.
        if wait_idle(copies, budget + DRAIN_POLL_S, DRAIN_POLL_S):
            stop_all([http] + [c.proc for c in copies], STOP_GRACE_S)
        else:
            stop_all([http], max(deadline - time.time(), 0) + STOP_GRACE_S)
            stop_all([c.proc for c in copies], STOP_GRACE_S)
        log.info("stopped")
        return 0
