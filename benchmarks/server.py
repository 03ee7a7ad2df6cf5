"""The server configurations the benchmarks compare, each run as a real `lmi serve` process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests

BASE = {
    # the Falcon-40B study's dynamic config
    "dynamic": "engine=Python\nbatch_size=4\nmax_batch_delay=100\n",
    # continuous batching, padded KV cache
    "rolling": "engine=Python\noption.rolling_batch=scheduler\noption.max_rolling_batch_size=32\n"
               "option.max_rolling_batch_prefill_tokens=1024\n",
    # continuous batching, paged KV cache
    "paged": "engine=Python\noption.rolling_batch=lmi-dist\noption.max_rolling_batch_size=32\n"
             "option.max_rolling_batch_prefill_tokens=1024\n",
}


def config_properties() -> dict[str, str]:
    return dict(BASE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    """properties: the whole serving.properties text instead of BASE[name] + dtype (None: unset, the
    host's default) + KV memory + extra
    (then `streams` says whether the engine streams); env: the server's environment; session: the
    launcher in a session of its own (it puts each child in its own too): `kill_tree` ends them all."""

    def __init__(self, name: str, model_dir: str, dtype: str | None = "bf16", kv_cache_memory: str = "1GiB",
                 extra: list[str] = (), properties: str | None = None, streams: bool | None = None,
                 env: dict[str, str] | None = None, session: bool = False):
        base = name.split("+")[0]
        self.name = name
        self.streams = base != "dynamic" if streams is None else streams
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if properties is None:
            props = BASE[base] + (f"option.dtype={dtype}\n" if dtype else "") + \
                f"option.kv_cache_memory={kv_cache_memory}\n"  # dtype None: the host's default
            props += "".join(item.split(":", 1)[1] + "\n" for item in extra if item.split(":", 1)[0] == name)
        else:
            props = properties
        self.dir = tempfile.mkdtemp(prefix=f"bench-{name}-")
        path = os.path.join(self.dir, "serving.properties")
        with open(path, "w") as f:
            f.write(props)
        self.log_path = os.path.join(self.dir, "server.log")
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "container.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--properties", path, "--model-dir", model_dir]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=session)
        self.session = session
        self._groups: set[int] = set()

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited; see {self.log_path}")
            try:
                if requests.get(self.url + "/ping", timeout=2).status_code == 200:
                    self._groups |= _descendant_groups(self.proc.pid)
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} server not ready; see {self.log_path}")

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self._groups |= _descendant_groups(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

    def kill_tree(self, wait: float = 10) -> None:
        """SIGKILL the launcher's process group and every group of a child it started (engine,
        HTTP workers, MPI ranks), then wait up to `wait` s for them to be gone (GPU memory freed)."""
        groups = self._groups | ({self.proc.pid} if self.session else set())
        if self.proc.poll() is None:
            groups |= _descendant_groups(self.proc.pid)
        groups.discard(os.getpgrp())  # never our own
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.poll()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
            time.sleep(0.1)


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group), from /proc (Linux; empty elsewhere)."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def _descendant_groups(pid: int) -> set[int]:
    table = _processes()
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, pgid) in table.items():
            if ppid == parent and child not in found:
                found.add(child)
                todo.append(child)
    return {table[p][1] for p in found}


def _group_alive(pgid: int) -> bool:
    return any(group == pgid for _, group in _processes().values())
