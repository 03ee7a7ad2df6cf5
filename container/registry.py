"""The models the server serves, launcher side (docs/multi-model.md): registration, loading within
the memory budget, unloading (in-flight requests finish first), placement on devices or cores, and
the table the HTTP workers read (engines/process/models.py).

    register(name, url, options)  refusals first (allow-list, custom code, configuration, budget), then load
    load(name)                    an unloaded model's next request: load it again, making room if needed
    unregister(name)              new requests 404 at once; those in flight finish; then its engines stop
    scale(name, options)          its engines restarted with the new number of copies
    check(spawn, env)             one supervision turn over every model (the launcher's loop)

Loads (and the unloads that make room for them) run one at a time under `_loading`; the table is
published after every change of state.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import msgspec

from container.model_group import ModelGroup, Spawn, wait_idle
from container.registration import Refusal, Registration
from engines.config import LmiConfig
from engines.process.models import (FAILED, LOADING, READY, UNLOADED, UNLOADING, ModelRecord, ModelTable, last_used,
                                    used_path, write_table)
from engines.weights.memory_plan import gib

log = logging.getLogger("container.launcher")

STOP_GRACE_S = 10.0
UNLOAD_GRACE_S = 3.0  # an unloaded model's engines are idle: nothing to finish, and loads wait for the memory


@dataclass
class Entry:
    name: str
    url: str
    config: LmiConfig
    need_bytes: int
    startup: bool = False
    state: str = LOADING
    group: ModelGroup | None = None
    dir: str | None = None
    loads: int = 0
    unloads: int = 0
    evictions: int = 0
    detail: str = ""
    loaded_at: float = 0.0
    cores: list[int] = field(default_factory=list)  # CPU: the cores its copies are pinned to
    devices: list[str] = field(default_factory=list)  # GPU: the devices its copies hold

    def record(self) -> ModelRecord:
        where = (f"gpu {','.join(self.devices)}" if self.devices else
                 f"cpu cores {','.join(map(str, self.cores))}" if self.cores else "all cores")
        return ModelRecord(self.name, self.url, self.state, self.dir if self.group else None,
                           self.config.scheduler.engine_kind, self.config.parallel.copies, where, self.need_bytes,
                           self.loaded_at, self.startup, self.loads, self.detail, self.unloads, self.evictions)


@dataclass(frozen=True)
class Settings:
    budget_bytes: int
    device_bytes: int  # per GPU (0 on CPU)
    num_gpus: int
    cores: tuple[int, ...]
    multi_model: bool
    gpu_ids: tuple[str, ...] = ()


class Registry:
    def __init__(self, run_dir: str, settings: Settings, spawn: Spawn, env: dict[str, str]):
        self.run_dir = run_dir
        self.settings = settings
        self.spawn = spawn
        self.env = env
        self.entries: dict[str, Entry] = {}
        self._lock = threading.RLock()
        self._loading = threading.Lock()
        self._seq = itertools.count(1)

    @property
    def multi(self) -> bool:
        return self.settings.multi_model or len(self.entries) > 1

    def publish(self) -> None:
        with self._lock:
            write_table(self.run_dir, ModelTable(tuple(e.record() for e in self.entries.values()), self.multi,
                                                 self.settings.budget_bytes))

    def groups(self) -> list[ModelGroup]:
        with self._lock:
            return [e.group for e in self.entries.values() if e.group is not None]

    # -- the model the server started with ---------------------------------------------------------
    def add_startup(self, name: str, url: str, config: LmiConfig, need: int) -> ModelGroup:
        group = ModelGroup(name, config, self.run_dir)
        entry = Entry(name, url, config, need, startup=True, state=READY, group=group, dir=self.run_dir, loads=1,
                      loaded_at=time.time(), cores=[c for cores in config.parallel.copy_cores for c in cores],
                      devices=[d for devices in config.parallel.copy_devices for d in devices])
        with self._lock:
            self.entries[name] = entry
        group.write_configs()
        open(used_path(self.run_dir), "a").close()
        return group

    # -- supervision ----------------------------------------------------------------------------
    def check(self) -> str | None:
        """One turn over every model; the reason the server must stop, when it must."""
        with self._lock:
            entries = [e for e in self.entries.values() if e.group is not None]
        for e in entries:
            group = e.group
            if group is None:
                continue
            reason = group.check(self.spawn, self.env, restart_alone=self.multi) or \
                (group.loading_too_long() if not group.ready else None)
            if reason is None:
                continue
            if e.startup and (not self.multi or not group.ready):
                return reason
            if group.ready:  # it served, and a restart failed: failed until its next request loads it again
                self._fail(e, group, reason)
            else:
                group.failure = group.failure or reason
                group.ready_event.set()  # (its load gives up, stops it, and says why)
        return None

    def _fail(self, entry: Entry, group: ModelGroup, reason: str) -> None:
        log.error("model %s: its engine did not come back (%s); its next request loads it again", entry.name, reason)
        with self._lock:
            entry.state, entry.group, entry.detail = FAILED, None, reason
        self.publish()
        group.mark_dead(reason)
        threading.Thread(target=group.stop, args=(STOP_GRACE_S,), daemon=True).start()

    # -- management ------------------------------------------------------------------------------
    def register(self, reg: Registration, synchronous: bool = True) -> tuple[int, dict]:
        with self._lock:
            if reg.name in self.entries:
                raise Refusal(409, f"Model {reg.name} is already registered.")
            entry = self.entries[reg.name] = Entry(reg.name, reg.url, reg.config, reg.need_bytes)
        self.publish()
        if not synchronous:
            threading.Thread(target=self._register_quietly, args=(entry,), daemon=True).start()
            return 202, {"status": f"Model \"{reg.name}\" registration scheduled."}
        self._first_load(entry)
        return 200, {"status": f"Model \"{reg.name}\" registered."}

    def _register_quietly(self, entry: Entry) -> None:
        try:
            self._first_load(entry)
        except Refusal as exc:
            log.error("model %s was not registered: %s", entry.name, exc.message)

    def _first_load(self, entry: Entry) -> None:
        """A failed first load leaves nothing registered."""
        try:
            with self._loading:
                self._load(entry)
        except Refusal:
            with self._lock:
                self.entries.pop(entry.name, None)
            self.publish()
            raise

    def load(self, name: str) -> None:
        """An unloaded (or failed) model asked for: load it; a model loading now: wait for it."""
        with self._loading:
            entry = self._entry(name)
            if entry.state in (UNLOADED, FAILED):
                self._load(entry)
            elif entry.state == UNLOADING:
                raise Refusal(404, f"Model or workflow not found: {name} (it is being unregistered)")

    def unregister(self, name: str) -> dict:
        entry = self._entry(name)
        if entry.state in (LOADING,):
            with self._loading:  # (wait for its load to end)
                entry = self._entry(name)
        self._unload(entry, keep=False)
        return {"status": f"Model or workflow \"{name}\" unregistered"}

    def scale(self, name: str, copies: int) -> dict:
        """DJL's PUT /models/<name>?min_worker=&max_worker=: the model reloaded with `copies` copies (requests
        in flight finish on the old ones)."""
        with self._loading:
            entry = self._entry(name)
            if entry.state != READY:
                raise Refusal(503, f"Model or workflow is not ready: {name}")
            limit = len(self.settings.cores) if not self.settings.num_gpus else \
                self.settings.num_gpus // entry.config.parallel.ranks
            if copies > max(limit, 1):
                raise Refusal(400, f"max_worker={copies}: this machine holds at most {max(limit, 1)} copies of {name}")
            per_copy = entry.need_bytes // max(entry.config.parallel.copies, 1)
            self._unload(entry, keep=True, reason="scaled")
            par = msgspec.structs.replace(entry.config.parallel, copies=copies, copy_cores=[], copy_devices=[])
            entry.config = msgspec.structs.replace(entry.config, parallel=par)
            entry.need_bytes = per_copy * copies
            self._load(entry)
        return {"status": f"Workflow \"{name}\" worker scaled. New Worker configuration min workers:{copies} "
                          f"max workers:{copies}"}

    def _entry(self, name: str) -> Entry:
        with self._lock:
            entry = self.entries.get(name)
        if entry is None:
            raise Refusal(404, f"Model or workflow not found: {name}")
        return entry

    # -- loading and unloading --------------------------------------------------------------------
    def _load(self, entry: Entry) -> None:
        """Make room, place it, start its engines and wait until they serve (caller holds _loading)."""
        self._make_room(entry)
        config, entry.cores, entry.devices = self._place(entry)
        slot = next(self._seq)
        directory = os.path.join(self.run_dir, "models", f"{slot}-{entry.name}")
        group = ModelGroup(entry.name, config, directory, label=f"model {entry.name}: ", port_slot=slot)
        group.write_configs()
        open(used_path(directory), "a").close()
        log.info("model %s: loading from %s (%s, %s of the %s budget, %s)", entry.name, entry.url,
                 config.scheduler.engine_kind, gib(entry.need_bytes), gib(self.settings.budget_bytes),
                 entry.record().where if entry.cores or entry.devices else "all cores")
        started = time.monotonic()
        group.start(self.spawn, self.env)
        with self._lock:
            entry.state, entry.group, entry.dir, entry.detail = LOADING, group, directory, ""
        self.publish()
        group.ready_event.wait(config.server.model_loading_timeout_s + 5.0)
        if not group.ready:
            reason = group.failure or group.loading_too_long() or "its engine did not get ready"
            with self._lock:
                entry.state, entry.group, entry.detail = FAILED, None, reason
            self.publish()
            group.stop(STOP_GRACE_S)
            shutil.rmtree(directory, ignore_errors=True)
            log.error("model %s: failed to load: %s", entry.name, reason)
            raise Refusal(424, f"model {entry.name} failed to load: {reason}")
        os.utime(used_path(directory))  # its last use is now: the model a request waits for is not the next to go
        with self._lock:
            entry.state, entry.loads, entry.loaded_at = READY, entry.loads + 1, time.time()
        self.publish()
        log.info("model %s: ready after %.1f s (load %d)", entry.name, time.monotonic() - started, entry.loads)

    def _make_room(self, entry: Entry) -> None:
        """Unload the least recently used idle models until `entry` fits the budget; 507 when it cannot."""
        budget = self.settings.budget_bytes
        if entry.need_bytes > budget:
            raise Refusal(507, f"model {entry.name} needs {gib(entry.need_bytes)}, more than the whole memory budget "
                               f"of {gib(budget)} (option.max_models_memory)")
        while True:
            with self._lock:
                used = sum(e.need_bytes for e in self.entries.values() if e.group is not None and e is not entry)
                idle = [e for e in self.entries.values() if e.state == READY and e is not entry]
            if used + entry.need_bytes <= budget:
                return
            if not idle:
                raise Refusal(507, f"model {entry.name} needs {gib(entry.need_bytes)}: {gib(budget - used)} of the "
                                   f"{gib(budget)} budget is free and no idle model can be unloaded")
            victim = min(idle, key=lambda e: last_used(e.dir) if e.dir else 0.0)
            log.info("model %s: unloading it (least recently used) to make room for %s", victim.name, entry.name)
            self._unload(victim, keep=True, reason="evicted")

    def _unload(self, entry: Entry, keep: bool, reason: str = "unregistered") -> None:
        """New requests stop coming (404, or for a kept model a reload), those in flight finish (within
        option.predict_timeout), then its engines stop."""
        with self._lock:
            group, entry.state, entry.detail = entry.group, UNLOADING, reason
        self.publish()
        if group is not None:
            wait_idle(group.copies, entry.config.scheduler.predict_timeout_s)
        with self._lock:
            entry.group = None
            if keep:
                entry.state, entry.detail = UNLOADED, reason
                entry.evictions += reason == "evicted"
                entry.unloads += 1
            else:
                self.entries.pop(entry.name, None)
        self.publish()
        if group is not None:
            group.mark_dead(f"the model {entry.name} was unloaded")
            group.stop(UNLOAD_GRACE_S)
            if not entry.startup:
                shutil.rmtree(group.dir, ignore_errors=True)
        log.info("model %s: %s", entry.name, "unloaded" if keep else "unregistered")

    # -- placement --------------------------------------------------------------------------------
    def _place(self, entry: Entry) -> tuple[LmiConfig, list[int], list[str]]:
        """GPU: each copy on the tensor_parallel_degree devices with the most room (several small models share a
        GPU; one that needs a whole device gets one alone). CPU: each copy on its share of the least used cores."""
        config, par = entry.config, entry.config.parallel
        with self._lock:
            others = [e for e in self.entries.values() if e.group is not None and e is not entry]
        if self.settings.num_gpus:
            per_rank = entry.need_bytes // max(par.copies * par.ranks, 1)
            held = {d: 0 for d in self.settings.gpu_ids}
            for e in others:
                for d in e.devices:
                    held[d] = held.get(d, 0) + e.need_bytes // max(len(e.devices), 1)
            chosen = place_on_devices(held, self.settings.device_bytes, per_rank, par.ranks, par.copies)
            if chosen is None:
                raise Refusal(507, f"model {entry.name} needs {gib(per_rank)} on each of {par.ranks} GPU(s) per copy: "
                                   "no GPU has that much room left")
            par = msgspec.structs.replace(par, copy_devices=chosen)
            return msgspec.structs.replace(config, parallel=par), [], [d for c in chosen for d in c]
        usage = {c: 0 for c in self.settings.cores}
        for e in others:
            for c in (e.cores or self.settings.cores):
                usage[c] = usage.get(c, 0) + 1
        share = max(par.ranks, len(usage) // (len(others) + 1) // max(par.copies, 1))
        chosen = place_on_cores(usage, share, par.copies)
        par = msgspec.structs.replace(par, copy_cores=chosen)
        return msgspec.structs.replace(config, parallel=par), [c for cores in chosen for c in cores], []

    def stop_all(self, grace: float) -> None:
        for group in self.groups():
            group.stop(grace)


def place_on_cores(usage: dict[int, int], share: int, copies: int) -> list[list[int]]:
    """Each copy's `share` cores: the least used first (ties: the lowest number)."""
    usage, chosen = dict(usage), []
    for _ in range(copies):
        cores = sorted(sorted(usage, key=lambda c: (usage[c], c))[:share])
        for c in cores:
            usage[c] += 1
        chosen.append(cores)
    return chosen


def place_on_devices(held: dict[str, int], device_bytes: int, per_rank: int, ranks: int,
                     copies: int) -> list[list[str]] | None:
    """Each copy's `ranks` devices: those with the most room that still fit `per_rank`; None when they do not."""
    held, chosen = dict(held), []
    for _ in range(copies):
        fits = sorted((d for d in held if device_bytes - held[d] >= per_rank), key=lambda d: (held[d], d))[:ranks]
        if len(fits) < ranks:
            return None
        for d in fits:
            held[d] += per_rank
        chosen.append(sorted(fits))
    return chosen
