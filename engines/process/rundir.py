"""The per-launch run directory the server's processes share (never a fixed path or port): each model
copy's folder, its engine socket, the ready, draining and failure files, and the environment and port
settings the launcher hands the engine processes."""

from __future__ import annotations

import os

CORES_ENV = "LMI_CPU_CORES"  # a model copy's cores on CPU, set by the launcher (engines/process/serve.py pins to them)
# torch.distributed's rendezvous port on rank 0's host (GPU ranks): MASTER_PORT, else this; the launcher
# gives copy i this + i
DIST_PORT = 29511


def copy_dirs(run_dir: str, copies: int) -> list[str]:
    """Each model copy's directory (its config, socket, ready and failure files): the run directory
    itself for one copy, run_dir/copy-<i> for several (docs/copies.md)."""
    return [run_dir] if copies <= 1 else [os.path.join(run_dir, f"copy-{i}") for i in range(copies)]


def engine_socket_path(run_dir: str) -> str:
    return f"ipc://{run_dir}/engine.sock"


def ready_path(run_dir: str) -> str:
    """The engine creates this once it serves (the launcher's sign that the server started)."""
    return f"{run_dir}/engine.ready"


def draining_path(run_dir: str) -> str:
    """The launcher writes the drain deadline (wall-clock seconds) here on SIGTERM."""
    return f"{run_dir}/draining"


def failure_path(run_dir: str, who: str) -> str:
    """Where a process of the server writes, in one sentence, why it could not start or go on
    ("engine": the HTTP workers fail requests once it exists; "http": a worker could not boot)."""
    return f"{run_dir}/{who}.failed"


def write_atomically(path: str, text: str) -> None:
    """Readers polling for the file never see half of it."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_failure(run_dir: str, who: str, reason: str) -> None:
    write_atomically(failure_path(run_dir, who), reason.strip().splitlines()[0] if reason.strip() else "unknown failure")


def read_failure(run_dir: str, who: str) -> str | None:
    try:
        with open(failure_path(run_dir, who), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
