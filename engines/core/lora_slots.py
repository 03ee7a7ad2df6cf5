"""Which LoRA adapter sits in which device slot: the scheduler's side of option.max_loras (pure
Python, no torch).

    slots 1..max_loras (0: the base model)

    acquire(name)  a request is admitted: its adapter's slot, loading it first when it is not
                   resident (into a free slot, else the least recently used slot nobody holds)
    release(name)  a request leaves the running batch (finished, aborted, preempted)
    hold(req) / let_go(req)   the same for a request, remembered on it (both engines use these)

A running request holds its adapter's slot, so an adapter in use is never evicted; a slot nobody
holds keeps its adapter (the next request for it loads nothing) until another adapter needs the
slot. A pinned adapter holds its slot for good. A request whose adapter cannot get a slot (every
slot held) waits; requests behind it for resident adapters go on.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from engines.core.request import Request


class LoraSlots:
    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        self.max_loras = max_loras
        self.slot_of: dict[str, int] = {}  # resident adapters
        self.num_holders: Counter[str] = Counter()  # running requests (and a pin) holding each
        self.pinned: set[str] = set()
        self._idle: OrderedDict[str, int] = OrderedDict()  # resident, held by nobody: least recently used first
        self._free = list(range(max_loras, 0, -1))  # pop() takes the lowest

    def can_acquire(self, name: str) -> bool:
        return name in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, name: str) -> tuple[int, bool]:
        """→ (its slot, whether the adapter must be loaded into it first)."""
        slot = self.slot_of.get(name)
        load = slot is None
        if load:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                evicted, slot = self._idle.popitem(last=False)
                del self.slot_of[evicted]
            else:
                raise ValueError(f"no LoRA slot for {name!r}: all {self.max_loras} are held (check can_acquire)")
            self.slot_of[name] = slot
        self._idle.pop(name, None)
        self.num_holders[name] += 1
        return slot, load

    def hold(self, req: Request) -> int | None:
        """A request joins the running batch: its adapter's slot held until `let_go(req)`. → the slot to
        load the adapter into first, or None when it is resident already (or the request has none)."""
        if req.lora_name is None:
            return None
        slot, load = self.acquire(req.lora_name)
        req.holds_lora_slot = True
        return slot if load else None

    def let_go(self, req: Request) -> None:
        """A request leaves the running batch (finished, aborted, preempted): its slot, if it held one."""
        if req.holds_lora_slot:
            req.holds_lora_slot = False
            self.release(req.lora_name)

    def release(self, name: str) -> None:
        self.num_holders[name] -= 1
        if self.num_holders[name] < 0:
            raise AssertionError(f"LoRA adapter {name!r} released more often than acquired")
        if not self.num_holders[name]:
            del self.num_holders[name]
            self._idle[name] = self.slot_of[name]  # most recently used last

    def place(self, name: str, slot: int) -> None:
        """An adapter loaded into a free slot outside the scheduler (at start)."""
        self._free.remove(slot)
        self.slot_of[name] = slot
        self._idle[name] = slot

    def pin(self, name: str) -> tuple[int, bool]:
        """Hold the adapter's slot for good (DJL's `pin`): → acquire's answer. ValueError when no slot
        can be had (every slot held)."""
        if not self.can_acquire(name):
            raise ValueError(f"every one of the {self.max_loras} LoRA slots is held (option.max_loras)")
        got = self.acquire(name) if name not in self.pinned else (self.slot_of[name], False)
        self.pinned.add(name)
        return got

    def forget(self, name: str) -> int | None:
        """An adapter unregistered (nobody but its pin holds it): its slot is free again. → the slot."""
        if name in self.pinned:
            self.pinned.discard(name)
            self.release(name)
        if self.num_holders[name]:
            raise AssertionError(f"LoRA adapter {name!r} is still held by {self.num_holders[name]} requests")
        del self.num_holders[name]
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._idle.pop(name, None)
            self._free.append(slot)
            self._free.sort(reverse=True)
        return slot

    def check_invariants(self, holders: Counter[str]) -> None:
        """holders: the running requests per adapter. Raise AssertionError unless the books agree."""
        want = holders + Counter(self.pinned)
        if +self.num_holders != want:
            raise AssertionError(f"LoRA slot holders {dict(self.num_holders)} != running requests {dict(want)}")
        if set(self._idle) != set(self.slot_of) - set(want):
            raise AssertionError("idle LoRA slots disagree with the held ones")
        slots = list(self.slot_of.values()) + self._free
        if sorted(slots) != list(range(1, self.max_loras + 1)):
            raise AssertionError(f"LoRA slots lost or doubled: {sorted(slots)}")
