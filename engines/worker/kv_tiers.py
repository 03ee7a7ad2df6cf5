"""KV tiers below the paged cache (docs/kv-tiers.md): each rank writes every full block it caches
to a host-memory tier (a folder in shared memory, /dev/shm: the model copies on a host share it)
and a disk tier (option.kv_offload_dir, kept across restarts), and loads blocks back into the
pool when the scheduler finds a prompt's next blocks there.

    save(refs)   the blocks' K/V (every held layer, K then V) → one payload per block → each tier:
                 write-through, when the block is first cached (its tokens' K/V are final then)
    load(refs)   per block: the host tier, else the disk tier (copied up to the host tier) → the
                 pool; False for a block no tier gave (missing, or refused: torn, foreign)

A block's payload, whatever the backend's layout, is its slice of each cache viewed as bytes:

    cache [H, N + 1, B, D] (torch, flex) or [N + 1, B, H, D] (flash), block dim `block_dim`
    payload of block b = stack(cache.select(block_dim, b) for K, V of every held layer)   # [2L, ...] bytes

On a GPU the slices are gathered and copied to pinned host memory on a stream of their own, after
the step that computed them (the next step waits for the gather only, not for the host copy); the
files are written once the copy is done (`poll` after each launch, or the next tier call). On a
CPU the pool is host memory already: the copy and the writes happen in the call.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os

import msgspec
import torch

from engines.core.plan import BlockRef
from engines.worker.block_files import BlockFiles

log = logging.getLogger(__name__)


class KvTierSettings(msgspec.Struct, frozen=True):
    """Per rank: where each tier lives and its bytes (0: no such tier)."""

    memory_dir: str = "/dev/shm/lmi-kv"
    memory_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0


def model_fingerprint(model_dir: str) -> bytes:
    """What tells one model's weights from another's without reading them all: config.json, and
    each weight file's name, size, safetensors header and first MiB of data (a fine-tune of the same
    architecture differs there). No timestamps: a fresh download of the same model matches."""
    digest = hashlib.blake2b(digest_size=16)
    config = os.path.join(model_dir, "config.json")
    if os.path.exists(config):
        with open(config, "rb") as f:
            digest.update(f.read())
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        for path in sorted(glob.glob(os.path.join(model_dir, pattern))):
            with open(path, "rb") as f:
                digest.update(f"{os.path.basename(path)}|{os.path.getsize(path)}|".encode() + f.read(1 << 20))
    return digest.digest()


class KvTiers:
    def __init__(self, settings: KvTierSettings, backend, layout: str, rank: int):
        """layout: everything besides the model that shapes a block's bytes (engines/worker/paged_runner.py)."""
        self.backend = backend
        self.namespace = hashlib.blake2b(layout.encode(), digest_size=16).digest()
        folder = lambda root: os.path.join(root, self.namespace.hex(), f"r{rank}")  # noqa: E731
        self.tiers: list[BlockFiles] = []
        if settings.memory_bytes:
            self.tiers.append(BlockFiles("host", folder(settings.memory_dir), self.namespace, settings.memory_bytes))
        if settings.disk_dir and settings.disk_bytes:
            self.tiers.append(BlockFiles("disk", folder(settings.disk_dir), self.namespace, settings.disk_bytes))
        for tier in self.tiers:
            tier.scan()
        # every held layer's K then V, each viewed as bytes (one dtype for every kind of cache)
        self.caches = [c.view(torch.uint8) for i in backend.held for c in (backend.keys[i], backend.values[i])]
        self.block_dim = backend.block_dim
        self.block_shape = self.caches[0].select(self.block_dim, 0).shape
        self.payload_len = len(self.caches) * self.block_shape.numel()
        self.cuda = backend.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(backend.device) if self.cuda else None
        # the last save: host rows, the event of their copy (GPU), the blocks, the device rows
        self._pending: tuple | None = None

    def describe(self) -> str:
        return "; ".join(f"{t.name} tier {t.folder}: {t.capacity / 2**20:.0f} MiB, {len(t.held)} blocks "
                         f"({t.num_bytes / 2**20:.1f} MiB) found" for t in self.tiers)

    def held_run(self, hashes: list[int]) -> int:
        """How many of the blocks, from the first, some tier holds (this rank's files)."""
        n = 0
        while n < len(hashes) and any(t.has(hashes[n]) for t in self.tiers):
            n += 1
        return n

    def save(self, refs: list[BlockRef]) -> None:
        """Snapshot the blocks' K/V now (before a later step reuses them); write them to every tier."""
        self.finish_writes()
        if not refs:
            return
        idx = torch.tensor([r.block_id for r in refs], device=self.backend.device)
        if self.cuda:
            compute = torch.cuda.current_stream(self.backend.device)
            self.copy_stream.wait_stream(compute)  # after the step that computed them
            with torch.cuda.stream(self.copy_stream):
                rows = self._gather(idx)  # on the device, block first
                gathered = torch.cuda.Event()
                gathered.record(self.copy_stream)
                snap = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                snap.copy_(rows, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            compute.wait_event(gathered)  # a later step may overwrite the blocks once gathered, not before
            self._pending = (snap, copied, refs, rows)  # (rows lives until the host copy is done)
        else:
            self._pending = (self._gather(idx), None, refs, None)
            self.finish_writes()

    def poll(self) -> None:
        """Write the last save's files if its copy is done (a GPU's copy stream): never waits."""
        if self._pending is not None and (self._pending[1] is None or self._pending[1].query()):
            self.finish_writes()

    def finish_writes(self) -> None:
        """Wait for the last save's copy, then write its files."""
        if self._pending is None:
            return
        snap, event, refs, _ = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        rows = snap.numpy()
        for ref, row in zip(refs, rows):
            for tier in self.tiers:
                tier.write(ref.hash, ref.parent, ref.tokens, memoryview(row))

    def load(self, refs: list[BlockRef]) -> list[int]:
        """Each block from the highest tier that holds it, into the pool → per block, the index in
        `tiers` of the tier that gave it, -1 where none could."""
        self.finish_writes()
        found: list[bytes | None] = []
        source: list[int] = []
        for ref in refs:
            payload, given = None, -1
            for i, tier in enumerate(self.tiers):
                payload = tier.read(ref.hash, ref.parent, ref.tokens, self.payload_len)
                if payload is not None:
                    given = i
                    for upper in self.tiers[:i]:  # up a tier: the next hit is nearer
                        upper.write(ref.hash, ref.parent, ref.tokens, memoryview(payload))
                    break
            found.append(payload)
            source.append(given)
        loaded = [(ref.block_id, p) for ref, p in zip(refs, found) if p is not None]
        if loaded:
            rows = torch.frombuffer(bytearray(b"".join(p for _, p in loaded)), dtype=torch.uint8)
            rows = rows.view(len(loaded), len(self.caches), *self.block_shape).to(self.backend.device)
            idx = torch.tensor([b for b, _ in loaded], device=self.backend.device)
            for i, cache in enumerate(self.caches):
                cache.index_copy_(self.block_dim, idx, rows[:, i].movedim(0, self.block_dim))
        return source

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        """[n, payload bytes]: the blocks' slices of every cache, block first."""
        parts = [c.index_select(self.block_dim, idx).movedim(self.block_dim, 0) for c in self.caches]
        return torch.stack(parts, 1).reshape(len(idx), -1)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for tier in self.tiers:
            out.update(tier.metrics())
        return out
