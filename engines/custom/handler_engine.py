"""A custom handler as the engine (docs/custom-handlers.md): DJL's `model.py` with `handle(inputs)`.

At load: a `requirements.txt` beside the handler is installed (pip, into the run directory, first on
the handler's import path, so the server's own environment is left as it is); the handler is
imported with the model dir on its path; then its warm-up call: `handle(Input)` with no content and
the model's properties. Any failure stops the start, and the reason is the traceback's last line.

Serving: one HTTP request per call, one call at a time (a DJL worker runs one job at a time), in
arrival order; `Output` → HandlerReply; a handler that raises gives 424 `{"code", "message":
"prediction failure", "error"}` and the engine goes on; `None` gives 204.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
import traceback

from engines.config import LmiConfig
from engines.process.errors import HandlerError
from engines.protocol import Abort, AdapterCommand, AdapterReply, Add, HandlerCall, HandlerReply, HealthReply, Output

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800


def last_line(exc: BaseException) -> str:
    """The last line of the exception's traceback ("ValueError: ...")."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


class HandlerEngine:
    def __init__(self, config: LmiConfig, publish, run_dir: str | None = None):
        self.config = config
        self.run_dir = run_dir  # requirements.txt installs under it
        self._publish = publish
        self.entry = config.model.entry_point
        self.name = os.path.basename(self.entry) if self.entry.endswith(".py") else self.entry
        self.handle = None
        self._queue: collections.deque[HandlerCall] = collections.deque()
        self._aborted: set[str] = set()
        self._ready = threading.Condition()
        self._num_calls = 0
        self._running = 0

    # -- load --------------------------------------------------------------------------------------------------

    def load(self) -> None:
        model_dir = self.config.model.local_dir
        where = os.path.dirname(self.entry) if self.entry.endswith(".py") else model_dir
        self._install_requirements(os.path.join(where, "requirements.txt"))
        for path in (where, model_dir):
            if path and path not in sys.path:
                sys.path.insert(0, path)
        try:
            module = self._import()
        except BaseException as exc:  # noqa: BLE001 — whatever the handler's import raises stops the start
            log.error("custom handler %s failed at import:\n%s", self.name, "".join(traceback.format_exception(exc)))
            raise HandlerError(f"custom handler {self.name} failed at import: {last_line(exc)}") from None
        self.handle = getattr(module, "handle", None)
        if not callable(self.handle):
            raise HandlerError(f"custom handler {self.name} defines no handle(inputs) function")
        from djl_python import Input
        started = time.perf_counter()
        try:
            self.handle(Input(dict(self.config.model.handler_properties)))
        except BaseException as exc:  # noqa: BLE001
            log.error("custom handler %s failed in its warm-up call:\n%s", self.name,
                      "".join(traceback.format_exception(exc)))
            raise HandlerError(f"custom handler {self.name} failed at start: {last_line(exc)}") from None
        log.info("custom handler %s ready (warm-up call: %.1f s)", self.name, time.perf_counter() - started)

    def _install_requirements(self, path: str) -> None:
        if not os.path.isfile(path):
            return
        target = os.path.join(self.run_dir or os.path.dirname(path), "handler-packages")
        log.info("installing %s into %s", path, target)
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                   "--target", target, "-r", path], capture_output=True, text=True,
                                  timeout=PIP_TIMEOUT_S, cwd=os.path.dirname(path))
        except subprocess.TimeoutExpired:
            raise HandlerError(f"pip install -r {path} did not finish within {PIP_TIMEOUT_S} s") from None
        if done.returncode:
            lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
            raise HandlerError(f"pip install -r {path} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
        sys.path.insert(0, target)
        log.info("installed %s in %.1f s", path, time.perf_counter() - started)

    def _import(self):
        if not self.entry.endswith(".py"):
            return importlib.import_module(self.entry)
        name = "lmi_custom_handler_" + os.path.splitext(os.path.basename(self.entry))[0]
        spec = importlib.util.spec_from_file_location(name, self.entry)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    # -- serve -------------------------------------------------------------------------------------------------

    def submit(self, msg) -> None:
        if isinstance(msg, HandlerCall):
            with self._ready:
                if len(self._queue) >= self.config.scheduler.job_queue_size:
                    self._publish([HandlerReply(msg.request_id, 503, "the request queue is full", {},
                                                [(None, b"the request queue is full (job_queue_size)")])])
                    return
                self._queue.append(msg)
                self._ready.notify()
        elif isinstance(msg, Abort):
            with self._ready:
                self._aborted.add(msg.request_id)
        elif isinstance(msg, AdapterCommand):
            self._publish([AdapterReply(msg.request_id, 404, "a custom handler serves this model: no LoRA adapters")])
        elif isinstance(msg, Add):  # (the HTTP workers send custom-handler requests as HandlerCall)
            self._publish([Output(msg.request_id, [], finished=True, finish_reason="error", error_code=400,
                                  error="this model is served by a custom handler: send requests to /invocations")])

    def health(self, state: str) -> HealthReply:
        return HealthReply(state, num_waiting=len(self._queue), num_running=self._running,
                           num_batches=self._num_calls)

    def stop_ranks(self) -> None:
        """One process: nothing to stop."""

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._ready:
                if not self._queue:
                    self._ready.wait(timeout=0.2)
                    continue
                call = self._queue.popleft()
                if call.request_id in self._aborted:  # the client left before its turn
                    self._aborted.discard(call.request_id)
                    continue
            self._running = 1
            try:
                self._publish([self.call(call)])
            finally:
                self._running = 0
                self._num_calls += 1
                self._aborted.discard(call.request_id)

    def call(self, call: HandlerCall) -> HandlerReply:
        from djl_python import Input, Output
        from djl_python.pair_list import PairList

        inputs = Input(call.properties, PairList(pair_list=[(k, v) for k, v in call.content]))
        try:
            out = self.handle(inputs)
        except Exception as exc:  # noqa: BLE001 — the handler's failure is this request's, not the engine's
            log.error("[%s] custom handler %s raised:\n%s", call.request_id, self.name,
                      "".join(traceback.format_exception(exc)))
            out = Output().error(last_line(exc))
        if out is None:
            return HandlerReply(call.request_id, 204, "No content")
        if not isinstance(out, Output):
            out = Output().error(f"handle() returned {type(out).__name__}, not a djl_python Output", code=500,
                                 message="handler error")
        content = [(k, bytes(v)) for k, v in zip(out.content.keys, out.content.values)]
        return HandlerReply(call.request_id, int(out.code), str(out.message),
                            {str(k): str(v) for k, v in out.properties.items()}, content)
