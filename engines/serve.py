"""The engine process: `python -m engines.serve --run-dir DIR`.

Reads the launcher's config from DIR/config.json, binds the engine socket at once (so HEALTH
answers "loading" while weights load), builds the engine the config selects, then runs its loop
until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from engines.config import ENGINE_DYNAMIC, ENGINE_PAGED, ENGINE_ROLLING, LmiConfig
from engines.endpoint import EngineEndpoint
from engines.protocol import STATE_DEAD, STATE_LOADING, STATE_READY, HealthReply, engine_socket_path

log = logging.getLogger("engines.serve")


def build_engine(config: LmiConfig, publish):
    kind = config.scheduler.engine_kind
    if kind == ENGINE_DYNAMIC:
        from engines.dynamic.batcher import DynamicEngine

        return DynamicEngine(config, publish)
    if kind == ENGINE_ROLLING:
        from engines.worker.rolling_engine import RollingEngine

        return RollingEngine(config, publish)
    if kind == ENGINE_PAGED:
        from engines.worker.paged_engine import PagedEngine

        return PagedEngine(config, publish)
    raise ValueError(f"unknown engine kind {kind!r}")


class EngineProcess:
    def __init__(self, run_dir: str):
        self.config = LmiConfig.read(os.path.join(run_dir, "config.json"))
        self.state = STATE_LOADING
        self.detail = ""
        self.stop = threading.Event()
        self.engine = None
        self._pending = []  # messages that arrive while loading
        self._lock = threading.Lock()
        self.endpoint = EngineEndpoint(engine_socket_path(run_dir), self._on_message, self._health)

    def _on_message(self, msg) -> None:
        with self._lock:
            if self.engine is None or self.state != STATE_READY:
                self._pending.append(msg)
                return
        self.engine.submit(msg)

    def _health(self) -> HealthReply:
        if self.engine is not None and self.state == STATE_READY:
            try:  # read from the IO thread while the engine steps: never let it take the thread down
                return self.engine.health(self.state)
            except Exception as exc:
                return HealthReply(self.state, detail=f"engine statistics unavailable: {exc}")
        return HealthReply(self.state, detail=self.detail)

    def run(self) -> int:
        self.endpoint.start()
        try:
            engine = build_engine(self.config, self.endpoint.publish)
            engine.load()
        except Exception as exc:
            log.exception("engine failed to load")
            self.state, self.detail = STATE_DEAD, f"engine failed to load: {exc}"
            return 3
        with self._lock:
            self.engine, self.state = engine, STATE_READY
            pending, self._pending = self._pending, []
        for msg in pending:
            engine.submit(msg)
        log.info("engine ready (%s)", self.config.scheduler.engine_kind)
        try:
            engine.run(self.stop)
        finally:
            self.endpoint.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.serve")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    proc = EngineProcess(args.run_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proc.stop.set())
    return proc.run()


if __name__ == "__main__":
    sys.exit(main())
