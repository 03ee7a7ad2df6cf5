"""The start-up timeline: one log line per phase with its duration, and the same figures in /metrics.

    launcher (container/cli.py):  imports → configuration → model_resolve   → <run dir>/startup.json
    engine   (engines/process/serve.py):  engine_imports → weight_load → warm_up → kv_allocation → warm_up_buckets → ready

The engine process reads the launcher's phases, adds its own, and hands the whole record out with
its HEALTH replies, which its IO thread answers (the engine loop does nothing for it); each HTTP
worker's /metrics then shows `lmi_startup_phase_seconds{phase=...}`. `ready` is the whole cold
start: from the launcher process's start to the engine serving. Pure Python, no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

log = logging.getLogger(__name__)

PHASES = ("imports", "configuration", "model_resolve", "engine_imports", "weight_load", "warm_up", "kv_allocation",
          "warm_up_buckets", "ready")


def process_age() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


class Timeline:
    """Phases of one start-up, in order: name → seconds."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.started_at = time.time() - process_age()  # wall clock of the (launcher) process start

    def record(self, name: str, seconds: float, detail: str = "") -> None:
        seconds = self.phases[name] = round(seconds, 4)  # the log and /metrics print the same figure
        log.info("startup phase %s: %.2f s%s", name, seconds, f" ({detail})" if detail else "")

    @contextlib.contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - started)

    def mark_ready(self) -> None:
        self.record("ready", time.time() - self.started_at, "cold start, from the launcher's start")

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"started_at": self.started_at, "phases": self.phases}, f)

    def adopt(self, path: str) -> None:
        """Take the launcher's phases and start time (absent when an engine runs without a launcher)."""
        try:
            with open(path, encoding="utf-8") as f:
                earlier = json.load(f)
        except OSError:
            return
        self.started_at = earlier["started_at"]
        self.phases = {**earlier["phases"], **self.phases}


def throughput(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes:,} bytes, {num_bytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


def startup_path(run_dir: str) -> str:
    return os.path.join(run_dir, "startup.json")


TIMELINE = Timeline()  # this process's
