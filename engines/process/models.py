"""The models one server serves (docs/multi-model.md), as the launcher publishes them to the HTTP
workers, and the management commands the workers send the launcher.

    launcher ──writes──► run_dir/models.json   (ModelTable: each model's name, state, run directory)
    workers  ──stat/read per request (re-read when its mtime changes)
    workers  ──ModelCommand──► run_dir/control.sock ──ModelReply──► workers     (register, unload, ...)
    workers  ──touch──► <model dir>/used          (its last use: the launcher unloads the least recent)

A model's run directory is the run directory itself for the model the server started with, and
run_dir/models/<n>-<name> for each model registered at run time (a new one for every load, so that
nothing of an earlier load's socket or files is mistaken for the new one's).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import zmq

from engines.process.rundir import write_atomically

LOADING, READY, UNLOADING, UNLOADED, FAILED = "loading", "ready", "unloading", "unloaded", "failed"


class ModelRecord(msgspec.Struct, frozen=True):
    name: str
    url: str
    state: str
    dir: str | None = None  # its run directory while loaded (config.json, copies, engine socket)
    engine_kind: str = ""
    copies: int = 1
    where: str = ""  # its devices or cores, said ("cpu cores 0-1", "gpu 2,3")
    need_bytes: int = 0  # what the memory budget counts for it
    loaded_at: float = 0.0
    startup: bool = False  # the model the server started with
    loads: int = 0  # how many times it was loaded (a worker's Service of an older load is dropped)
    detail: str = ""  # why it failed, or was unloaded
    unloads: int = 0  # unloaded while registered (to make room, or to scale)
    evictions: int = 0  # of those, to make room for another model


class ModelTable(msgspec.Struct, frozen=True):
    models: tuple[ModelRecord, ...] = ()
    multi: bool = False  # several models or SageMaker's multi-model mode: metrics labelled, crashes restarted
    budget_bytes: int = 0

    def get(self, name: str) -> ModelRecord | None:
        return next((m for m in self.models if m.name == name), None)


class ModelCommand(msgspec.Struct, frozen=True):
    """register (url, options) | unregister | scale (options min_worker/max_worker) | load (an
    unloaded model's next request) | describe."""
    op: str
    name: str = ""
    url: str = ""
    options: dict[str, str] = {}
    synchronous: bool = True


class ModelReply(msgspec.Struct, frozen=True):
    code: int
    body: Any = None  # a JSON value: the answer, or the error sentence when code is not 2xx


def models_path(run_dir: str) -> str:
    return os.path.join(run_dir, "models.json")


def control_socket_path(run_dir: str) -> str:
    return f"ipc://{run_dir}/control.sock"


def used_path(model_dir: str) -> str:
    return os.path.join(model_dir, "used")


def write_table(run_dir: str, table: ModelTable) -> None:
    write_atomically(models_path(run_dir), msgspec.json.encode(table).decode())


def read_table(run_dir: str) -> ModelTable:
    with open(models_path(run_dir), "rb") as f:
        return msgspec.json.decode(f.read(), type=ModelTable)


def touch(model_dir: str) -> None:
    """A request for the model: its last use, for the launcher's least-recently-used order."""
    try:
        os.utime(used_path(model_dir))
    except OSError:
        pass


def last_used(model_dir: str) -> float:
    try:
        return os.stat(used_path(model_dir)).st_mtime
    except OSError:
        return 0.0


def ask(run_dir: str, command: ModelCommand, timeout_s: float) -> ModelReply | None:
    """Send the launcher one command and wait for its reply (None when none comes in time)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control_socket_path(run_dir))
        sock.send(msgspec.msgpack.encode(command))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return msgspec.msgpack.decode(sock.recv(), type=ModelReply)
    finally:
        sock.close()
