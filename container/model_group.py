"""One served model's engine processes: its copies (maxWorkers), each an engine group (mpirun and
its ranks, or one process), started, watched and stopped by the launcher.

    ModelGroup.check()   one supervision turn: a copy that got ready, died, or must be restarted
    ModelGroup.stop()    SIGTERM to every copy's session, then SIGKILL after the grace

A copy that dies after it served is restarted while the model's other copies go on; with
`restart_alone` (several models behind the server, docs/multi-model.md) a model whose only copy
dies is restarted too, instead of stopping the server. A copy that never got ready fails the model.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from engines.config import LmiConfig
from engines.process.rundir import (CORES_ENV, DIST_PORT, copy_dirs, engine_socket_path, failure_path, read_failure,
                                    ready_path, write_failure)

log = logging.getLogger("container.launcher")

DEAD_LINGER_S = 1.5  # after the engine died: /ping says 503 and in-flight requests get 424, then restart or exit
PORTS_PER_MODEL = 64  # torch.distributed rendezvous ports of one model's copies: MASTER_PORT + slot * this + copy


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


class EngineCopy:
    """One model copy's engine group: its directory, its devices or cores, its process."""

    def __init__(self, index: int, directory: str, config: LmiConfig, port_slot: int = 0):
        self.index = index
        self.dir = directory
        self.config = config
        self.port_slot = port_slot
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
        torch.distributed's rendezvous (GPU ranks): a port of its own (MASTER_PORT + its model's slot and its
        index) on rank 0's host (with a hostfile its first host, the leader)."""
        env = dict(base)
        par = self.config.parallel
        env["MASTER_PORT"] = str(int(base.get("MASTER_PORT") or DIST_PORT) + self.port_slot * PORTS_PER_MODEL
                                 + self.index)
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


Spawn = Callable[[str, list[str], dict[str, str]], subprocess.Popen]


class ModelGroup:
    """A model's copies. `label` names it in the log ("" for the one model of a single-model server)."""

    def __init__(self, name: str, config: LmiConfig, run_dir: str, *, label: str = "", port_slot: int = 0):
        self.name = name
        self.config = config
        self.dir = run_dir
        self.label = label
        self.copies = [EngineCopy(i, d, config, port_slot) for i, d in enumerate(copy_dirs(run_dir,
                                                                                          config.parallel.copies))]
        self.ready = False  # every copy got ready once (the model serves)
        self.ready_event = threading.Event()  # set once it serves, or once it failed
        self.failure: str | None = None  # why it cannot serve (a copy never got ready, or died alone)

    def write_configs(self) -> None:
        for directory in {self.dir, *(c.dir for c in self.copies)}:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "config.json"), "wb") as f:
                f.write(self.config.to_json())

    def start(self, spawn: Spawn, env: dict[str, str]) -> None:
        for c in self.copies:
            what = "engine" if len(self.copies) == 1 else f"engine copy {c.index}"
            c.proc = spawn(f"{self.label}{what}", c.command(), c.environment(env))

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.copies if c.proc is not None]

    def check(self, spawn: Spawn, env: dict[str, str], *, restart_alone: bool) -> str | None:
        """One supervision turn; the reason the server must stop (a single model's copy died, or one never
        got ready at start), else None. A model failed while loading sets `failure` and its event."""
        for c in self.copies:
            if c.restart_at is not None:
                if time.monotonic() >= c.restart_at:
                    c.clear()
                    c.proc = spawn(f"{self.label}engine copy {c.index} again", c.command(), c.environment(env))
                continue
            if c.proc.poll() is None and c.ready and read_failure(c.dir, "engine") is not None:
                # the engine said it is dead and its group lingers: mpirun can hang aborting a job
                # with a rank it cannot reach (tests/test_multinode.py saw it): end the group
                c.failed_at = c.failed_at or time.monotonic()
                if time.monotonic() - c.failed_at > DEAD_LINGER_S:
                    log.error("%sthe engine reported a failure and its process group did not exit: killing it",
                              self.label)
                    signal_group(c.proc, signal.SIGKILL)
                    c.proc.wait()
            if c.proc.poll() is not None:
                c.ready = c.ready or os.path.exists(ready_path(c.dir))
                reason = read_failure(c.dir, "engine") or f"the engine exited with code {c.proc.returncode}"
                if not c.ready or (len(self.copies) == 1 and not restart_alone):
                    self.failure = reason if len(self.copies) == 1 else f"model copy {c.index}: {reason}"
                    self.ready_event.set()
                    return self.failure
                log.error("%smodel copy %d died (%s): restarting it%s", self.label, c.index, reason,
                          "; the other copies go on serving" if len(self.copies) > 1 else "")
                if read_failure(c.dir, "engine") is None:  # its HTTP requests fail with 424 now
                    write_failure(c.dir, "engine", reason)
                c.restarts += 1
                c.ready, c.restart_at = False, time.monotonic() + DEAD_LINGER_S
            elif not c.ready and os.path.exists(ready_path(c.dir)):
                c.ready = True
                if self.ready and c.restarts:
                    log.info("%smodel copy %d is back after %.1f s", self.label, c.index, time.monotonic() - c.started)
        if not self.ready and all(c.ready for c in self.copies):
            self.ready = True
            self.ready_event.set()
        return None

    def loading_too_long(self) -> str | None:
        limit = self.config.server.model_loading_timeout_s
        if not self.ready and any(not c.ready and time.monotonic() - c.started > limit for c in self.copies):
            return f"the engine was not ready within option.model_loading_timeout={limit:.0f} s"
        return None

    def mark_dead(self, reason: str) -> None:
        """Tell the HTTP workers (503 on /ping, 424 for requests in flight), unless the engine has said so itself."""
        for c in self.copies:
            if read_failure(c.dir, "engine") is None:
                write_failure(c.dir, "engine", reason)

    def stop(self, grace: float) -> None:
        stop_all(self.procs, grace)


def wait_idle(copies: list[EngineCopy], limit_s: float, poll_s: float = 0.05) -> bool:
    """Until every live copy reports nothing running or waiting twice in a row (True), at most `limit_s`
    (False); a copy whose process has exited counts as idle."""
    from handlers.engine_client import EngineClient

    probes = [EngineClient(engine_socket_path(c.dir)) for c in copies]
    deadline, idle_in_a_row = time.monotonic() + limit_s, 0
    try:
        while idle_in_a_row < 2 and time.monotonic() < deadline and \
                any(c.proc is not None and c.proc.poll() is None for c in copies):
            replies = [p.health(timeout=min(1.0, limit_s)) if c.proc is not None and c.proc.poll() is None else None
                       for p, c in zip(probes, copies)]
            idle = all(r is not None and r.num_running == 0 and r.num_waiting == 0 or
                       r is None and (c.proc is None or c.proc.poll() is not None) for r, c in zip(replies, copies))
            idle_in_a_row = idle_in_a_row + 1 if idle else 0
            time.sleep(poll_s)
    finally:
        for p in probes:
            p.close()
    return idle_in_a_row >= 2 or not any(c.proc is not None and c.proc.poll() is None for c in copies)


def stop_all(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every child's session at once, then each waited for, at most `grace` seconds in all,
    then killed with its session's leftovers (ranks, workers)."""
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0f s: killing it", proc.pid, grace)
        signal_group(proc, signal.SIGKILL)  # leftovers of the session (ranks, workers)
        proc.wait()


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
