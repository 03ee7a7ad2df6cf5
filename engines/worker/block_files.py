"""One KV tier's storage: a folder of block files, one per full KV block, least recently used
evicted past a byte budget (no torch: the payload is bytes).

    <root>/<namespace>/r<rank>/<hash as 16 hex digits>.kv

The namespace is a digest of everything that makes two caches' K/V differ (model weights,
dtype, KV dtype, block size, tensor-parallel layout: engines/worker/kv_tiers.py), so that another
model's tier is another folder. A file is

    header   magic "LMIKV\\0\\1\\0" | namespace (16 bytes) | hash (u64) | payload crc32 (u32) |
             payload length (u64) | parent length (u16) | tokens length (u32)
    parent   the block's parent as the prefix cache chains it (block_manager.parent_bytes)
    tokens   its token ids, int32
    payload  this rank's K and V of the block, every layer it holds

and is written to a temporary name and renamed, so a reader sees a whole file or none. A read
checks every field against what the caller expects and the payload's crc32: a truncated, foreign
or colliding file is refused (logged, deleted) and the block is recomputed.

The folder is the index: several processes (model copies on one host) share one tier by sharing
the folder; each evicts what it wrote or found at start, within its share of the budget.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections import OrderedDict

log = logging.getLogger(__name__)

MAGIC = b"LMIKV\0\1\0"
_HEADER = struct.Struct("<8s16sQIQHI")


def block_path(folder: str, block_hash: int) -> str:
    return os.path.join(folder, f"{block_hash:016x}.kv")


class BlockFiles:
    """One tier (`name`: host | disk) of one rank: block files under `folder`, at most `capacity` bytes."""

    def __init__(self, name: str, folder: str, namespace: bytes, capacity: int):
        self.name = name
        self.folder = folder
        self.namespace = namespace
        self.capacity = capacity
        self.held: OrderedDict[int, int] = OrderedDict()  # hash → file bytes, least recently used first
        self.num_bytes = 0
        self.num_refused = 0  # files refused on start or on read: torn, foreign, colliding
        self.num_write_errors = 0  # writes the file system refused (full, folder gone): the block is not kept
        self.bytes_written = 0
        self.num_read = self.bytes_read = 0
        self.read_seconds = 0.0
        os.makedirs(folder, exist_ok=True)

    def scan(self) -> None:
        """Index the files already there (a restart, or another copy's), oldest first; refuse the
        ones whose header is not ours or whose length disagrees with it."""
        entries = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tmp"):
                _remove(entry.path)  # a write cut short (a crash between write and rename)
                continue
            if not entry.name.endswith(".kv"):
                continue
            try:
                why = self._check_header(entry.path)
                st = entry.stat()
            except OSError:
                continue  # removed meanwhile (another copy's eviction)
            if why:
                self._refuse(entry.path, why)
                continue
            entries.append((st.st_mtime, int(entry.name[:-3], 16), st.st_size))
        for _, block_hash, size in sorted(entries):
            self.held[block_hash] = size
            self.num_bytes += size
        self._evict()

    def has(self, block_hash: int) -> bool:
        """Whether the file is there (written by this process or another copy; one stat call)."""
        return os.path.exists(block_path(self.folder, block_hash))

    def write(self, block_hash: int, parent: bytes, tokens: bytes, payload: memoryview) -> None:
        """Keep the block (a tier is a cache: a write the file system refuses is logged and counted,
        and the block is only not kept)."""
        if block_hash in self.held:
            return
        path = block_path(self.folder, block_hash)
        header = _HEADER.pack(MAGIC, self.namespace, block_hash, zlib.crc32(payload), len(payload), len(parent),
                              len(tokens))
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header + parent + tokens)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            self.num_write_errors += 1
            if self.num_write_errors in (1, 10, 100) or self.num_write_errors % 1000 == 0:
                log.warning("KV %s tier: cannot write %s (%s); %d writes failed so far", self.name, path, exc,
                            self.num_write_errors)
            _remove(tmp)
            return
        size = _HEADER.size + len(parent) + len(tokens) + len(payload)
        self.held[block_hash] = size
        self.num_bytes += size
        self.bytes_written += size
        self._evict()

    def read(self, block_hash: int, parent: bytes, tokens: bytes, payload_len: int) -> bytes | None:
        """The block's payload, or None: not here, or refused (logged, deleted)."""
        path = block_path(self.folder, block_hash)
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:  # gone (another copy evicted it), or unreadable
            if not isinstance(exc, FileNotFoundError):
                log.warning("KV %s tier: cannot read %s (%s); the block is recomputed", self.name, path, exc)
            self._drop(block_hash)
            return None
        why = self._check(data, block_hash, parent, tokens, payload_len)
        if why:
            self._refuse(path, why)
            self._drop(block_hash)
            return None
        if block_hash in self.held:
            self.held.move_to_end(block_hash)
        else:  # another copy's: ours to evict too, from now on
            self.held[block_hash] = len(data)
            self.num_bytes += len(data)
        try:
            os.utime(path)  # recently used, for a scan after a restart
        except OSError:
            pass  # (evicted by another copy since: the bytes read stand)
        self.num_read += 1
        self.bytes_read += len(data)
        self.read_seconds += time.perf_counter() - start
        return data[len(data) - payload_len:]

    def _check(self, data: bytes, block_hash: int, parent: bytes, tokens: bytes, payload_len: int) -> str:
        if len(data) < _HEADER.size:
            return f"truncated: {len(data)} bytes, shorter than a header"
        magic, namespace, h, crc, n, np, nt = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a KV block file"
        if namespace != self.namespace:
            return "written for another model, dtype, block size or layout (namespace differs)"
        if h != block_hash or n != payload_len:
            return f"holds block {h:016x} of {n} bytes, not {block_hash:016x} of {payload_len}"
        body = memoryview(data)[_HEADER.size:]
        if len(body) != np + nt + n:
            return f"truncated: {len(data)} bytes, the header says {_HEADER.size + np + nt + n}"
        if bytes(body[:np]) != parent or bytes(body[np:np + nt]) != tokens:
            return "holds other tokens (a hash collision)"
        if zlib.crc32(body[np + nt:]) != crc:
            return "payload checksum differs (torn or corrupted)"
        return ""

    def _check_header(self, path: str) -> str:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return f"truncated: {size} bytes, shorter than a header"
        magic, namespace, _, _, n, np, nt = _HEADER.unpack(head)
        if magic != MAGIC or namespace != self.namespace:
            return "not a KV block file of this namespace"
        if size != _HEADER.size + np + nt + n:
            return f"truncated: {size} bytes, the header says {_HEADER.size + np + nt + n}"
        return ""

    def _refuse(self, path: str, why: str) -> None:
        self.num_refused += 1
        log.warning("KV %s tier: refused %s: %s; the block is recomputed", self.name, path, why)
        _remove(path)

    def _drop(self, block_hash: int) -> None:
        size = self.held.pop(block_hash, None)
        if size is not None:
            self.num_bytes -= size

    def _evict(self) -> None:
        while self.num_bytes > self.capacity and self.held:
            block_hash, size = self.held.popitem(last=False)
            self.num_bytes -= size
            _remove(block_path(self.folder, block_hash))

    def metrics(self) -> dict[str, float]:
        n = self.name
        return {f"kv_tier_{n}_bytes": self.num_bytes, f"kv_tier_{n}_blocks": len(self.held),
                f"kv_tier_{n}_capacity_bytes": self.capacity, f"kv_tier_{n}_refused_blocks": self.num_refused,
                f"kv_tier_{n}_write_errors": self.num_write_errors,
                f"kv_tier_{n}_written_bytes": self.bytes_written, f"kv_tier_{n}_read_bytes": self.bytes_read,
                f"kv_tier_{n}_loaded_blocks": self.num_read, f"kv_tier_{n}_load_seconds": self.read_seconds}


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # gone already (another copy), or not ours to remove
