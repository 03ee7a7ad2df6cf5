"""A load-optimised copy of one rank's weights (`option.load_cache_dir`), as ServerlessLLM proposes:
each rank's parameters back to back in one file, read with large sequential reads on several
threads, instead of per-tensor slices of the safetensors files.

    <load_cache_dir>/<sha256(model dir, dtype)[:16]>/
        rank0-of2.bin     [param 0 bytes][pad to 4 KiB][param 1 bytes][pad] ...   (already sharded, in dtype)
        rank0-of2.json    {"format": 2, "source": fingerprint, "chunk_bytes": 16 MiB, "chunk_crc32": [...],
                           "tensors": {name: {dtype, shape, offset, nbytes}}}

The index is written last (after the data, each through a temporary file and a rename), so an index
means a complete file. The source fingerprint is a SHA-256 over every checkpoint file's name, size,
modification time and safetensors header: a changed checkpoint makes the cache stale (hashing every
byte would cost the full read the cache saves). A stale, truncated or corrupt cache (a CRC-32 per
16 MiB of the file, checked as it is read) is logged and rebuilt from the safetensors files.

Reading. On CPU the file is memory-mapped copy-on-write and its pages are read in 16 MiB pieces by
several threads (`madvise(MADV_POPULATE_READ)`: the kernel reads straight into the page cache and
maps those pages, so the weights are neither copied nor first-touched in fresh memory); each
parameter then *is* a view of the mapping. Measured on a 2 GB file with the page cache dropped
(benchmarks/load.py), this runs at the disk's own speed; reading into freshly allocated parameters
cost 1.6-2.5x that (page faults on 2 GB of new memory, one thread per large tensor). On CUDA the
same pieces go through a pair of pinned staging buffers with asynchronous copies to the device.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import logging
import mmap
import os
import struct
import zlib

import torch

log = logging.getLogger(__name__)

FORMAT = 2
ALIGN = 4096
CHUNK = 16 << 20  # the unit of reading, checking and staging
NUM_READ_THREADS = 4  # this VM's disk reads ~1.3x faster with 4 streams than with one
MADV_POPULATE_READ = 22  # Linux 5.14+
STAGING_BYTES = 64 << 20  # per pinned buffer on CUDA


class CacheMiss(Exception):
    """Why the cache cannot be used (one sentence for the log)."""


def cache_paths(cache_dir: str, model_dir: str, dtype: torch.dtype, rank: int, world_size: int) -> tuple[str, str]:
    key = hashlib.sha256(f"{os.path.realpath(model_dir)}|{dtype}".encode()).hexdigest()[:16]
    stem = os.path.join(cache_dir, key, f"rank{rank}-of{world_size}")
    return stem + ".bin", stem + ".json"


def source_fingerprint(files: list[str]) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        st = os.stat(path)
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = f.read(size)
        digest.update(f"{os.path.basename(path)}|{st.st_size}|{st.st_mtime_ns}|".encode() + header)
    return digest.hexdigest()


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy()).cast("B")


def _read_index(index_path: str, source: str, params: dict[str, torch.nn.Parameter]) -> dict:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CacheMiss("no cache yet") from None
    except (OSError, ValueError) as exc:
        raise CacheMiss(f"unreadable index ({exc})") from None
    if index.get("format") != FORMAT:
        raise CacheMiss(f"written in format {index.get('format', 1)}, this version reads {FORMAT}")
    if index.get("source") != source:
        raise CacheMiss("stale: the checkpoint files changed")
    entries = index.get("tensors", {})
    if set(entries) != set(params):
        raise CacheMiss("the index does not list this model's parameters")
    for name, p in params.items():
        e = entries[name]
        if e["shape"] != list(p.shape) or e["dtype"] != str(p.dtype):
            raise CacheMiss(f"{name}: {e['dtype']}{e['shape']} in the cache, {p.dtype}{list(p.shape)} in the model")
    return index


def load(model: torch.nn.Module, bin_path: str, index_path: str, source: str) -> int:
    """Fill every parameter from the cache; → bytes read. CacheMiss when it cannot be used."""
    params = dict(model.named_parameters())
    index = _read_index(index_path, source, params)
    entries, crcs, chunk = index["tensors"], index["chunk_crc32"], index["chunk_bytes"]
    end = max((e["offset"] + e["nbytes"] for e in entries.values()), default=0)
    size = os.path.getsize(bin_path)
    if size != index["file_bytes"] or size < end:
        raise CacheMiss(f"{'truncated' if size < index['file_bytes'] else 'wrong size'}: {size} bytes, "
                        f"the index says {index['file_bytes']}")
    if size == 0:
        return 0
    with open(bin_path, "rb") as f:  # copy-on-write: a write to a weight never reaches the file
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive while any view does
    starts = range(0, size, chunk)

    def read_and_check(i: int) -> None:
        start = starts[i]
        piece = data[start:start + chunk]
        _populate(piece)
        if zlib.crc32(piece.numpy()) != crcs[i]:  # crc32 releases the GIL
            inside = [n for n, e in entries.items() if e["offset"] < start + len(piece) and e["offset"] + e["nbytes"] > start]
            raise CacheMiss(f"corrupt: CRC-32 mismatch in bytes {start}-{start + len(piece)} "
                            f"({', '.join(inside[:3])}{', …' if len(inside) > 3 else ''})")

    if len(crcs) != len(starts):
        raise CacheMiss(f"the index has {len(crcs)} checksums for {len(starts)} pieces")
    with concurrent.futures.ThreadPoolExecutor(NUM_READ_THREADS) as pool:
        list(pool.map(read_and_check, range(len(starts))))
    views = {name: data[entries[name]["offset"]:entries[name]["offset"] + entries[name]["nbytes"]]
             .view(p.dtype).view(p.shape) for name, p in params.items()}
    if {p.device.type for p in params.values()} == {"cpu"}:
        for name, p in params.items():
            p.data = views[name]
    else:
        _copy_to_device(params, views)
    return size


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _populate(piece: torch.Tensor) -> None:
    """Read a piece of the mapping into memory now (not on first use)."""
    if _libc().madvise(ctypes.c_void_p(piece.data_ptr()), piece.numel(), MADV_POPULATE_READ) != 0:
        piece[::mmap.PAGESIZE].sum()  # an older kernel: touch one byte per page


def _copy_to_device(params: dict[str, torch.nn.Parameter], views: dict[str, torch.Tensor]) -> None:
    """Mapped host pages → two pinned staging buffers → asynchronous copies to each parameter."""
    staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    free = [None, None]  # the event after which each buffer may be overwritten
    turn = 0
    for name, p in params.items():
        src, dst = views[name].view(-1).view(torch.uint8), p.data.view(-1).view(torch.uint8)
        for lo in range(0, src.numel(), STAGING_BYTES):
            n = min(STAGING_BYTES, src.numel() - lo)
            if free[turn] is not None:
                free[turn].synchronize()
            buf = staging[turn][:n]
            buf.copy_(src[lo:lo + n])
            dst[lo:lo + n].copy_(buf, non_blocking=True)
            free[turn] = torch.cuda.Event()
            free[turn].record(torch.cuda.current_stream(p.device))
            turn ^= 1
    for event in free:
        if event is not None:
            event.synchronize()


class _ChunkedWriter:
    """Writes sequentially and keeps a CRC-32 of each CHUNK bytes of the file."""

    def __init__(self, f):
        self.f, self.offset, self.crcs, self._crc = f, 0, [], 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            room = CHUNK - self.offset % CHUNK
            part, data = data[:room], data[room:]
            self.f.write(part)
            self._crc = zlib.crc32(part, self._crc)
            self.offset += len(part)
            if self.offset % CHUNK == 0:
                self.crcs.append(self._crc)
                self._crc = 0

    def close(self) -> list[int]:
        if self.offset % CHUNK:
            self.crcs.append(self._crc)
        return self.crcs


def write(model: torch.nn.Module, bin_path: str, index_path: str, source: str) -> int:
    """Write this rank's parameters and their index; → bytes written."""
    os.makedirs(os.path.dirname(bin_path), exist_ok=True)
    entries = {}
    with open(bin_path + ".tmp", "wb") as f:
        out = _ChunkedWriter(f)
        for name, p in model.named_parameters():
            out.write(b"\0" * (-out.offset % ALIGN))
            data = _byte_view(p.data.cpu().contiguous())
            entries[name] = {"dtype": str(p.dtype), "shape": list(p.shape), "offset": out.offset, "nbytes": len(data)}
            out.write(data)
        crcs = out.close()
    os.replace(bin_path + ".tmp", bin_path)
    with open(index_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "source": source, "alignment": ALIGN, "file_bytes": out.offset,
                   "chunk_bytes": CHUNK, "chunk_crc32": crcs, "tensors": entries}, f)
    os.replace(index_path + ".tmp", index_path)
    return out.offset
