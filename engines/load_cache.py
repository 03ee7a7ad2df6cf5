"""A load-optimised copy of one rank's weights (`option.load_cache_dir`), as ServerlessLLM proposes:
each rank's parameters back to back in one file, read with large sequential reads on several
threads straight into the parameters, instead of per-tensor slices of the safetensors files.

    <load_cache_dir>/<sha256(model dir, dtype)[:16]>/
        rank0-of2.bin     [param 0 bytes][pad to 4 KiB][param 1 bytes][pad] ...   (already sharded, in dtype)
        rank0-of2.json    {"source": fingerprint, "tensors": {name: {dtype, shape, offset, nbytes, crc32}}}

The index is written last (after the data, each through a temporary file and a rename), so an index
means a complete file. The source fingerprint is a SHA-256 over every checkpoint file's name, size,
modification time and safetensors header: a changed checkpoint makes the cache stale (hashing every
byte would cost the full read the cache saves). A stale, truncated or corrupt cache (CRC-32 of each
tensor checked as it is read) is logged and rebuilt from the safetensors files.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import struct
import zlib

import torch

log = logging.getLogger(__name__)

ALIGN = 4096
NUM_READ_THREADS = 4


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


def load(model: torch.nn.Module, bin_path: str, index_path: str, source: str) -> int:
    """Fill every parameter from the cache; → bytes read. CacheMiss when it cannot be used."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CacheMiss("no cache yet") from None
    except (OSError, ValueError) as exc:
        raise CacheMiss(f"unreadable index ({exc})") from None
    if index.get("source") != source:
        raise CacheMiss("stale: the checkpoint files changed")
    params = dict(model.named_parameters())
    entries = index.get("tensors", {})
    if set(entries) != set(params):
        raise CacheMiss("the index does not list this model's parameters")
    for name, p in params.items():
        e = entries[name]
        if e["shape"] != list(p.shape) or e["dtype"] != str(p.dtype):
            raise CacheMiss(f"{name}: {e['dtype']}{e['shape']} in the cache, {p.dtype}{list(p.shape)} in the model")
    end = max((e["offset"] + e["nbytes"] for e in entries.values()), default=0)
    if os.path.getsize(bin_path) < end:
        raise CacheMiss(f"truncated: {os.path.getsize(bin_path)} bytes, the index needs {end}")
    fd = os.open(bin_path, os.O_RDONLY)
    try:
        with concurrent.futures.ThreadPoolExecutor(NUM_READ_THREADS) as pool:  # pread and crc32 release the GIL
            list(pool.map(lambda item: _read_into(fd, item[0], item[1], entries[item[0]]), params.items()))
    finally:
        os.close(fd)
    return end


def _read_into(fd: int, name: str, param: torch.nn.Parameter, entry: dict) -> None:
    on_host = param.device.type == "cpu"
    # CUDA: read into pinned memory, then an asynchronous copy to the device
    target = param.data if on_host else torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
    view, done, nbytes = _byte_view(target), 0, entry["nbytes"]
    while done < nbytes:
        got = os.preadv(fd, [view[done:nbytes]], entry["offset"] + done)
        if got <= 0:
            raise CacheMiss(f"short read of {name}")
        done += got
    if zlib.crc32(view[:nbytes]) != entry["crc32"]:
        raise CacheMiss(f"corrupt: CRC-32 mismatch in {name}")
    if not on_host:
        param.data.copy_(target, non_blocking=True)
        torch.cuda.current_stream(param.device).synchronize()


def write(model: torch.nn.Module, bin_path: str, index_path: str, source: str) -> int:
    """Write this rank's parameters and their index; → bytes written."""
    os.makedirs(os.path.dirname(bin_path), exist_ok=True)
    entries, offset = {}, 0
    with open(bin_path + ".tmp", "wb") as f:
        for name, p in model.named_parameters():
            data = _byte_view(p.data.cpu().contiguous())
            f.write(b"\0" * (-offset % ALIGN))
            offset += -offset % ALIGN
            f.write(data)
            entries[name] = {"dtype": str(p.dtype), "shape": list(p.shape), "offset": offset, "nbytes": len(data),
                             "crc32": zlib.crc32(data)}
            offset += len(data)
    os.replace(bin_path + ".tmp", bin_path)
    with open(index_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"source": source, "alignment": ALIGN, "tensors": entries}, f)
    os.replace(index_path + ".tmp", index_path)
    return offset
