"""The paged engine's LoRA adapters at run time (rank 0): which are served and from where, their
requests and tokens, and registration / unregistration between steps on every rank.

    register    read and checked on rank 0 first (a bad adapter is a 400, never a dead rank), then
                on the other ranks; pinned ones go into a slot at once
    unregister  new requests for it are refused at once (404); it goes, from every rank, once no
                request waiting or running uses it, and only then is the caller answered: evicting an
                adapter in use waits for its requests, which finish with it
    slots       engines/core/lora_slots.py: the scheduler places adapters in device slots (LRU)
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

from engines.core.lora_slots import LoraSlots
from engines.core.request import Request, Status
from engines.protocol import ADAPTER_REGISTER, AdapterCommand, AdapterInfo
from engines.worker.mirror import ActivateLora, Mirrored, RegisterLora, UnregisterLora

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9][\w.:/-]{0,255}$")


@dataclass
class AdapterStats:
    src: str
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class LoraRegistry:
    def __init__(self, ranks: Mirrored, slots: LoraSlots, reply):
        self.ranks = ranks  # every rank's step target (PagedRunner, PaddedBatch)
        self.lora = ranks.target.runner.lora  # rank 0's LoraAdapters
        self.slots = slots
        self._reply = reply  # (AdapterCommand, status, message) → the caller
        self.stats = {name: AdapterStats(path) for name, path in self.lora.sources.items()}
        self.unregistering: dict[str, list[AdapterCommand]] = {}
        for name, slot in self.lora.slots.items():  # placed at start on every rank
            slots.place(name, slot)

    def refusal(self, name: str) -> str | None:
        """Why a request for this adapter cannot be taken (None: it can)."""
        if name in self.unregistering:
            return f"LoRA adapter {name!r} is being unregistered"
        return self._unknown(name) if name not in self.stats else None

    def _unknown(self, name: str) -> str:
        return f"no LoRA adapter named {name!r}; this server serves: {', '.join(self.stats) or 'none'}"

    def command(self, msg: AdapterCommand, requests: dict[str, Request]) -> None:
        if msg.action == ADAPTER_REGISTER:
            self._register(msg)
        elif msg.name not in self.stats:
            self._reply(msg, 404, self._unknown(msg.name))
        else:
            self.unregistering.setdefault(msg.name, []).append(msg)
            self.retire_unused(requests)

    def _register(self, msg: AdapterCommand) -> None:
        name = msg.name
        if not NAME.match(name):
            return self._reply(msg, 400, f"{name!r} is not a usable adapter name: letters, digits and . _ - : / "
                                         "(starting with a letter or digit), 256 at most")
        if name in self.stats:
            return self._reply(msg, 400, f"a LoRA adapter named {name!r} is already registered (from "
                                         f"{self.stats[name].src}); unregister it first")
        if msg.pin and not self.slots.can_acquire(name):
            return self._reply(msg, 400, f"cannot pin {name!r}: every one of the {self.slots.max_loras} LoRA slots "
                                         "is held (option.max_loras)")
        try:
            adapter = self.lora.register(name, msg.path)
        except (OSError, ValueError, KeyError) as exc:
            return self._reply(msg, 400, f"LoRA adapter {name!r} from {msg.src or msg.path} cannot be served: {exc}")
        if self.ranks.comm.world_size > 1:
            self.ranks.send_others(RegisterLora(name, msg.path))
        self.stats[name] = AdapterStats(msg.src or msg.path)
        if msg.pin:
            slot, load = self.slots.pin(name)
            if load:
                self.ranks.call(ActivateLora(slot, name))
        log.info("LoRA adapter %s registered (r=%d, from %s%s)", name, adapter.rank, msg.src or msg.path,
                 ", pinned" if msg.pin else "")
        self._reply(msg, 200, f"Adapter {name} registered")

    def retire_unused(self, requests: dict[str, Request]) -> None:
        """Unregister the adapters asked to go that no request uses any more (called between steps)."""
        if not self.unregistering:
            return
        in_use = {r.lora_name for r in requests.values()}
        for name in [n for n in self.unregistering if n not in in_use]:
            self.ranks.call(UnregisterLora(name))
            self.slots.forget(name)
            del self.stats[name]
            log.info("LoRA adapter %s unregistered", name)
            for msg in self.unregistering.pop(name):
                self._reply(msg, 200, f"Adapter {name} unregistered")

    def hold_slot(self, req: Request) -> bool:
        """The padded engine admits a request: its adapter's slot held (loaded first on every rank when
        it is not resident); False when every slot is held by other adapters' rows."""
        if req.lora_name is not None and not self.slots.can_acquire(req.lora_name):
            return False
        load = self.slots.hold(req)
        if load is not None:
            self.ranks.call(ActivateLora(load, req.lora_name))
        return True

    def finished(self, req: Request) -> None:
        stats = self.stats.get(req.lora_name) if req.lora_name is not None else None
        if stats is not None:
            stats.requests += 1
            stats.prompt_tokens += req.num_prompt_tokens
            stats.generated_tokens += req.num_generated_tokens

    def infos(self, requests: dict[str, Request]) -> list[AdapterInfo]:
        running = Counter(r.lora_name for r in requests.values() if r.status is Status.RUNNING)
        waiting = Counter(r.lora_name for r in requests.values() if r.status is Status.WAITING)
        return [AdapterInfo(name, s.src, self.lora.ranks[name], self.slots.slot_of.get(name, 0),
                            name in self.slots.pinned, name in self.unregistering, running[name], waiting[name],
                            s.requests, s.prompt_tokens, s.generated_tokens) for name, s in self.stats.items()]
