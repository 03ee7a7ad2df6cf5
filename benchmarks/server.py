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
    def __init__(self, name: str, model_dir: str, dtype: str, kv_cache_memory: str, extra: list[str]):
        base = name.split("+")[0]
        self.name = name
        self.streams = base != "dynamic"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        props = BASE[base] + f"option.dtype={dtype}\noption.kv_cache_memory={kv_cache_memory}\n"
        props += "".join(item.split(":", 1)[1] + "\n" for item in extra if item.split(":", 1)[0] == name)
        self.dir = tempfile.mkdtemp(prefix=f"bench-{name}-")
        path = os.path.join(self.dir, "serving.properties")
        with open(path, "w") as f:
            f.write(props)
        self.log_path = os.path.join(self.dir, "server.log")
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "container.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--properties", path, "--model-dir", model_dir]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited; see {self.log_path}")
            try:
                if requests.get(self.url + "/ping", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} server not ready; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
