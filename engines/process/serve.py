"""The engine process: `python -m engines.process.serve --run-dir DIR`.

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

import msgspec

from engines.config import (ENGINE_DYNAMIC, ENGINE_HANDLER, ENGINE_PAGED, ENGINE_POOLING, ENGINE_ROLLING, LmiConfig,
                            runner_model)
from engines.dist import Communicator, SingleProcess, make_communicator, rank_info
from engines.process.endpoint import EngineEndpoint
from engines.process.ipc import high_water_mark
from engines.protocol import (FINISH_ERROR, STATE_DEAD, STATE_LOADING, STATE_READY, Add, Encode, Encoded, HandlerCall,
                              HandlerReply, HealthReply, Output)
from engines.process.rundir import CORES_ENV, engine_socket_path, ready_path, write_failure
from engines.process.errors import FatalStepError, HandlerError
from engines.process.startup import TIMELINE, process_age, startup_path

log = logging.getLogger("engines.process.serve")


def build_engine(config: LmiConfig, publish, comm: Communicator, run_dir: str | None = None):
    kind = config.scheduler.engine_kind
    if kind == ENGINE_DYNAMIC:
        from engines.dynamic.batcher import DynamicEngine

        return DynamicEngine(config, publish)
    if kind == ENGINE_ROLLING:
        from engines.loop.rolling_engine import RollingEngine

        return RollingEngine(config, publish, comm)
    if kind == ENGINE_PAGED:
        from engines.loop.paged_engine import PagedEngine

        return PagedEngine(config, publish, comm)
    if kind == ENGINE_HANDLER:
        from engines.custom.handler_engine import HandlerEngine

        return HandlerEngine(config, publish, run_dir)
    if kind == ENGINE_POOLING:
        from engines.pooling.engine import PoolingEngine

        return PoolingEngine(config, publish)
    raise ValueError(f"unknown engine kind {kind!r}")


def run_shard(config: LmiConfig, comm: Communicator) -> int:
    """Ranks > 0: load this rank's shard, then run whatever rank 0 runs, step by step."""
    from engines.worker.mirror import serve_steps
    from engines.worker.model_runner import ModelRunner

    from engines.spec import ModelSpec

    runner = ModelRunner(runner_model(config), ModelSpec.of(config.model), comm)
    runner.load()
    if config.scheduler.engine_kind == ENGINE_PAGED:
        from engines.worker.paged_runner import PagedRunner

        target = PagedRunner(runner)
    else:
        from engines.worker.padded_batch import PaddedBatch

        target = PaddedBatch(runner)
    log.info("rank %d ready", comm.rank)
    serve_steps(target, comm)
    if config.scheduler.engine_kind == ENGINE_PAGED:
        target.close()
    log.info("rank %d stopping", comm.rank)
    return 0


class EngineProcess:
    def __init__(self, config: LmiConfig, run_dir: str, comm: Communicator):
        self.config = config
        self.comm = comm
        self.run_dir = run_dir
        self.state = STATE_LOADING
        self.detail = ""
        self.stop = threading.Event()
        self.engine = None
        self._pending = []  # messages that arrive while loading, in arrival order
        self._lock = threading.Lock()
        TIMELINE.adopt(startup_path(run_dir))
        self.startup = dict(TIMELINE.phases)  # replaced whole once ready; read by the IO thread
        sched = config.scheduler
        self.endpoint = EngineEndpoint(engine_socket_path(run_dir), self._on_message, self._health,
                                       high_water_mark(sched.job_queue_size, sched.max_num_seqs))

    def _on_message(self, msg) -> None:
        with self._lock:  # against become_ready: a message never overtakes one that arrived before it
            if self.state == STATE_LOADING:
                self._pending.append(msg)
                return
            if self.state == STATE_DEAD:
                if isinstance(msg, Add):
                    self.endpoint.publish([Output(msg.request_id, [], finished=True, finish_reason=FINISH_ERROR,
                                                  error_code=503, error=f"the engine is not available: {self.detail}")])
                elif isinstance(msg, HandlerCall):
                    self.endpoint.publish([HandlerReply(msg.request_id, 503, "the engine is not available",
                                                        {}, [(None, self.detail.encode())])])
                elif isinstance(msg, Encode):
                    self.endpoint.publish([Encoded(msg.request_id, error_code=503,
                                                   error=f"the engine is not available: {self.detail}")])
                return
        self.engine.submit(msg)

    def _health(self) -> HealthReply:
        engine = self.engine
        if engine is not None and self.state == STATE_READY:
            try:  # the engine's own snapshot: its state is never read while it changes
                return msgspec.structs.replace(engine.health(self.state), startup=self.startup)
            except Exception as exc:
                return HealthReply(self.state, detail=f"engine statistics unavailable: {exc}", startup=self.startup)
        return HealthReply(self.state, detail=self.detail, startup=self.startup)

    def become_ready(self, engine) -> None:
        TIMELINE.mark_ready()
        self.startup = dict(TIMELINE.phases)
        with self._lock:
            for msg in self._pending:
                engine.submit(msg)
            self._pending = []
            self.engine, self.state = engine, STATE_READY
        with open(ready_path(self.run_dir), "w"):
            pass

    def die(self, reason: str) -> None:
        """Say why (HEALTH answers "dead" from now on, and the launcher reads the failure file)."""
        with self._lock:
            self.state, self.detail = STATE_DEAD, reason
        write_failure(self.run_dir, "engine", reason)

    def run(self) -> int:
        self.endpoint.start()
        try:
            engine = build_engine(self.config, self.endpoint.publish, self.comm, self.run_dir)
            if hasattr(engine, "on_stuck"):  # a stuck step: say so before exiting (mpirun may linger)
                engine.on_stuck = self.die
            TIMELINE.record("engine_imports", process_age(), "interpreter, torch, transformers, engine modules")
            engine.load()
        except Exception as exc:
            log.exception("engine failed to load")
            self.die(str(exc) if isinstance(exc, HandlerError) else
                     f"the engine failed to load the model: {type(exc).__name__}: {exc}")
            self.endpoint.close()
            return 3
        self.become_ready(engine)
        log.info("engine ready (%s)", self.config.scheduler.engine_kind)
        try:
            engine.run(self.stop)
        except FatalStepError as exc:
            # the ranks may be stuck in a collective: no goodbye to them, mpirun ends the group
            log.error("%s: exiting", exc)
            self.die(str(exc))
            self.endpoint.close()  # the failed requests' errors still go out
            self.endpoint.deliver_before_exit()
            logging.shutdown()
            os._exit(5)
        finally:
            engine.stop_ranks()
            self.endpoint.close()
        return 0


def pin_to_cores(spec: str | None, rank: int, world_size: int) -> list[int]:
    """Pin this process to its share of the copy's cores ("0,1,2,3": rank r of w takes every w-th from r);
    → the cores, [] when not pinned."""
    if not spec or not hasattr(os, "sched_setaffinity"):
        return []
    cores = [int(c) for c in spec.split(",") if c.strip()]
    mine = cores[rank::world_size] or cores
    os.sched_setaffinity(0, mine)
    return mine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.process.serve")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    info = rank_info(os.environ)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s engine[{info.rank}] %(levelname)s %(name)s: %(message)s")
    config = LmiConfig.read(os.path.join(args.run_dir, "config.json"))
    cores = pin_to_cores(os.environ.get(CORES_ENV), info.rank, info.world_size)
    if info.world_size > 1 or cores:
        import torch

        torch.set_num_threads(max(1, len(cores) if cores else (os.cpu_count() or 1) // info.world_size))
    comm = make_communicator(info, config.parallel.tensor_parallel_degree) if info.world_size > 1 else SingleProcess()
    if info.world_size > 1:
        # the default action, not a Python handler: a rank stuck in a collective with a dead peer
        # never returns to the interpreter. The HTTP side has drained before the launcher signals
        # the engine group, and mpirun signals the survivors when a rank dies.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    try:
        if info.rank > 0:
            return run_shard(config, comm)
        proc = EngineProcess(config, args.run_dir, comm)
        if info.world_size == 1:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: proc.stop.set())
        return proc.run()
    finally:
        comm.close()


if __name__ == "__main__":
    sys.exit(main())
