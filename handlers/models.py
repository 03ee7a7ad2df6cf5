"""The models this worker's routes reach (docs/multi-model.md): one `Service` per model, kept in step
with the launcher's table (engines/process/models.py), re-read when its mtime changes.

    pick(name)        the named model's Service for this request (g.service): 404 naming the served ones
                      when it is not registered; an unloaded one is loaded first (the launcher makes room)
    pick(None)        the one model, when there is one; several: 400 asking for model_name
    current()         (handlers/service.py) the Service picked for this request, else the one model

A model the launcher unloads or reloads gets a new Service on its next request; the old one's
requests in flight end with it.
"""

from __future__ import annotations

import logging
import os
import threading

from flask import current_app, g, request

from engines.config import LmiConfig, ServerConfig
from engines.process import models as table_io
from engines.process.ipc import high_water_mark
from engines.process.models import READY, UNLOADING, ModelCommand, ModelRecord, ModelTable
from engines.process.rundir import draining_path, engine_socket_path
from handlers import custom
from handlers.chat_template import ChatTemplate
from handlers.engine_client import EngineClient
from handlers.engine_pool import EnginePool
from handlers.errors import HttpError
from handlers.service import Service, read_body
from handlers.tokenizer import TextTokenizer

log = logging.getLogger("handlers.app")

TARGET_MODEL_HEADER = "X-Amzn-SageMaker-Target-Model"
LOAD_GRACE_S = 30.0  # beyond option.model_loading_timeout: the launcher's own wait, making room first
LOAD_ATTEMPTS = 5


def service_of(record: ModelRecord, drain_dir: str | None) -> Service:
    """A loaded model's Service: its configuration, tokenizer, chat template and engine client."""
    config = LmiConfig.read(os.path.join(record.dir, "config.json"))
    tokenizer = template = None
    if config.model.entry_point is None:  # (a custom handler tokenizes for itself, if at all)
        tokenizer = TextTokenizer(config.model.local_dir)
        template = ChatTemplate.load(config.model.local_dir, config.server.chat_template)
    sched = config.scheduler
    hwm = high_water_mark(sched.job_queue_size, sched.max_num_seqs)
    copies = config.parallel.copies
    client = EnginePool(record.dir, copies, hwm) if copies > 1 else \
        EngineClient(engine_socket_path(record.dir), hwm, refresh_health=True)
    return Service(config, client, tokenizer, record.dir, template, drain_dir=drain_dir)


class Models:
    def __init__(self, server: ServerConfig, run_dir: str | None = None, only: Service | None = None):
        self.server = server
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._services: dict[str, tuple[tuple[int, str | None], Service]] = {}
        self._mtime: int | None = None
        self._table = ModelTable()
        if only is not None:  # one Service, no launcher (tests of the HTTP layer)
            self._table = ModelTable((ModelRecord(only.model_name, "", READY, only.run_dir),))
            self._services[only.model_name] = ((0, only.run_dir), only)

    def table(self) -> ModelTable:
        if self.run_dir is None:
            return self._table
        try:
            mtime = os.stat(table_io.models_path(self.run_dir)).st_mtime_ns
        except OSError:
            return self._table
        if mtime != self._mtime:
            with self._lock:
                self._table, self._mtime = table_io.read_table(self.run_dir), mtime
        return self._table

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.table().models if not _is_leaving(m)]

    def service(self, name: str) -> Service:
        """`name`'s Service (loading it first when it is unloaded); 404 when no such model is served."""
        record = self.table().get(name)
        if record is None or _is_leaving(record):
            served = ", ".join(self.names) or "none (register one with POST /models)"
            raise HttpError(404, f"Model or workflow not found: {name}; this server serves {served}")
        if self.run_dir is not None and (record.state != READY or record.dir is None):
            record = self._load(record)
        if record.dir is not None:
            table_io.touch(record.dir)
        return self._service(record)

    def default(self) -> Service:
        names = self.names
        if len(names) == 1:
            return self.service(names[0])
        if not names:
            raise HttpError(404, "no model is served yet: register one with POST /models")
        raise HttpError(400, f"Parameter model_name is required: this server serves {', '.join(names)}; name one "
                             f"with /predictions/<model>, the model_name query parameter or header, or "
                             f"{TARGET_MODEL_HEADER}")

    def loaded(self) -> list[tuple[ModelRecord, Service]]:
        """Every model that serves now, with its Service (for /ping, /metrics, /v1/models)."""
        return [(m, self._service(m)) for m in self.table().models
                if m.state == READY and (m.dir is not None or self.run_dir is None)]

    def is_draining(self) -> bool:
        return self.run_dir is not None and os.path.exists(draining_path(self.run_dir))

    def body(self) -> bytes:
        return read_body(request.environ, request.content_length, self.server.max_request_size)

    def _service(self, record: ModelRecord) -> Service:
        key = (record.loads, record.dir)
        with self._lock:
            held = self._services.get(record.name)
            if held is not None and held[0] == key:
                return held[1]
            service = service_of(record, self.run_dir)
            self._services[record.name] = (key, service)
        if held is not None:  # an older load's: its engine is gone
            held[1].client.close()
        return service

    def _load(self, record: ModelRecord) -> ModelRecord:
        """Ask the launcher to load an unloaded model (or wait for one loading) and return its record. Loaded, it
        is the most recently used; should another load unload it before this request sees it, ask again."""
        for _ in range(LOAD_ATTEMPTS):
            reply = table_io.ask(self.run_dir, ModelCommand("load", record.name),
                                 self.server.model_loading_timeout_s + LOAD_GRACE_S)
            if reply is None:
                raise HttpError(503, f"model {record.name} is {record.state} and did not load in time; retry later")
            if reply.code != 200:
                raise HttpError(reply.code, str(reply.body))
            loaded = self.table().get(record.name)
            if loaded is not None and loaded.state == READY and loaded.dir is not None:
                return loaded
        raise HttpError(503, f"model {record.name} was unloaded {LOAD_ATTEMPTS} times before this request reached "
                             "it (more models in use than the memory budget holds); retry later")


def _is_leaving(record: ModelRecord) -> bool:
    return record.state == UNLOADING and record.detail == "unregistered"


def models() -> Models:
    return current_app.extensions["lmi_models"]


def pick(name: str | None = None) -> Service:
    """The request's model: `name`, else the one model; kept for current()."""
    service = models().service(name) if name else models().default()
    if service.handler is not None and not custom.serves(request.path):
        raise HttpError(404, custom.ROUTE_REFUSAL)
    g.service = service
    return service


def current() -> Service:
    """The Service of the model this request picked, else the one model's."""
    return g.get("service") or pick()


def invocation_model() -> str | None:
    """DJL's /invocations: the model_name query parameter or header, else SageMaker's target-model header
    (a model's name, or its artifact's path: `name.tar.gz`)."""
    name = request.args.get("model_name") or request.headers.get("model_name")
    if name:
        return name
    target = request.headers.get(TARGET_MODEL_HEADER)
    if not target:
        return None
    names = models().names
    for candidate in (target, target.rsplit("/", 1)[-1].removesuffix(".tar.gz")):
        if candidate in names:
            return candidate
    return target
