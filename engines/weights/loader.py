"""Load HF safetensors checkpoints (one file, or sharded with an index) into our model code.

Each rank reads only its slices, with positioned reads (`os.pread`) of exactly those bytes rather
than a memory map, so the checkpoint's pages never count in the rank's memory: its peak is about
its shard. A slice of rows is one read; a slice of columns is one read per row.

    file: [u64 header size][JSON header: name -> dtype, shape, data_offsets][tensor bytes ...]
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time

import torch

from engines.weights import load_cache, quant_load
from engines.weights.quant_checkpoint import read_checkpoint_quant

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str, declared: str | None) -> torch.dtype:
    """`option.dtype` → torch dtype; `auto` takes the checkpoint's (config.json's name for it; float32
    when it names none)."""
    if name != "auto":
        return TORCH_DTYPES[name]
    return getattr(torch, str(declared or "float32").replace("torch.", ""), torch.float32)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters (on this rank), and of weights packed outside them
    (engines/layers/quant.py: Int8DynamicWeight's `packed_bytes`)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(getattr(m, "packed_bytes", 0) for m in model.modules())


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no safetensors checkpoint in {model_dir} (model.safetensors or an index)")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """Slices of the tensors of one .safetensors file, read with pread."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        (size,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header = json.loads(os.pread(self._fd, size, 8))
        header.pop("__metadata__", None)
        self._base = 8 + size
        self.tensors = header  # name -> {"dtype", "shape", "data_offsets": [begin, end]}

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name]["shape"])

    def read(self, name: str, index: tuple) -> torch.Tensor:
        """tensor[index] for index = (rows,) or (rows, cols) of slices (step 1)."""
        meta = self.tensors[name]
        dtype, shape = _DTYPES[meta["dtype"]], list(meta["shape"])
        start = self._base + meta["data_offsets"][0]
        if not shape:
            return self._pread(start, dtype, [])
        itemsize = torch.empty((), dtype=dtype).element_size()
        row_items = 1
        for d in shape[1:]:
            row_items *= d
        r0, r1, _ = index[0].indices(shape[0])
        cols = index[1] if len(index) > 1 else slice(None)
        c0, c1, _ = cols.indices(shape[1]) if len(shape) > 1 else (0, 0, 1)
        if len(shape) == 1 or (c0 == 0 and c1 == shape[1]):  # whole rows: one read
            return self._pread(start + r0 * row_items * itemsize, dtype, [r1 - r0, *shape[1:]])
        assert len(shape) == 2, "column slices of tensors with more than two dimensions"
        out = torch.empty((r1 - r0, c1 - c0), dtype=dtype)
        width = (c1 - c0) * itemsize
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        for i, row in enumerate(range(r0, r1)):
            got = os.preadv(self._fd, [view[i * width:(i + 1) * width]], start + (row * shape[1] + c0) * itemsize)
            assert got == width, (name, row)
        return out

    def _pread(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if nbytes:
            view = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
            done = 0
            while done < nbytes:
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got <= 0:
                    raise IOError(f"{self.path}: short read")
                done += got
        return out


def build_model(cls, spec, model_dir: str, comm, dtype: torch.dtype, device: torch.device, progress: bool = True,
                load_cache_dir: str | None = None):
    """Construct `cls` with empty weights in `dtype` on `device` and fill them: from the load cache
    when `load_cache_dir` holds a valid one for this rank, else from the checkpoint (then written
    to the cache, when there is one)."""
    started = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(spec, comm)
    finally:
        torch.set_default_dtype(previous)
    files = checkpoint_files(model_dir)
    cache = source = None
    quant = read_checkpoint_quant(spec.config)
    if quant and load_cache_dir:
        log.info("option.load_cache_dir: not used for a pre-quantised (%s) checkpoint; loading the safetensors "
                 "files", quant.method)
    elif load_cache_dir:
        pipe = getattr(comm, "pipeline", None)  # one cache per rank of the world
        cache = load_cache.cache_paths(load_cache_dir, model_dir, dtype, *((pipe.world_rank, pipe.world_size) if pipe
                                                                           else (comm.rank, comm.world_size)))
        source = load_cache.source_fingerprint(files)
        try:
            nbytes = load_cache.load(model, *cache, source)
            log.info("loaded %d bytes from the load cache %s in %.2f s (rank %d)", nbytes, cache[0],
                     time.perf_counter() - started, comm.rank)
            return model.eval()
        except load_cache.CacheMiss as exc:
            level = logging.INFO if str(exc) == "no cache yet" else logging.WARNING
            log.log(level, "load cache %s: %s; loading the safetensors files and rebuilding it", cache[0], exc)
    _fill_from_checkpoint(model, files, comm.rank, progress, quant, dtype)
    log.info("loaded %d file(s) in %.1f s (rank %d)", len(files), time.perf_counter() - started, comm.rank)
    if cache:
        nbytes = load_cache.write(model, *cache, source)
        log.info("load cache written: %s (%d bytes)", cache[0], nbytes)
    return model.eval()


def _fill_from_checkpoint(model, files: list[str], rank: int, progress: bool, quant=None, dtype=None) -> None:
    """quant: a pre-quantised checkpoint's format (engines/weights/quant_load.py): its quantised linears are
    packed first, before the linears' own weights are ever touched; those no kernel takes load last,
    dequantised."""
    from tqdm import tqdm

    checkpoints = [SafetensorsFile(path) for path in files]
    names = [name for ckpt in checkpoints for name in ckpt.tensors]
    prefixes = quant_load.quantized_prefixes(names) if quant else set()
    quantized: dict[str, dict] = {}  # prefix → suffix → reader of the whole tensor
    plain = []
    for ckpt in checkpoints:
        for name in ckpt.tensors:
            reader = lambda idx, ckpt=ckpt, name=name: ckpt.read(name, idx)  # noqa: E731
            if quant_load.is_quantized_tensor(name, prefixes):
                prefix, _, suffix = name.rpartition(".")
                quantized.setdefault(prefix, {})[suffix] = lambda r=reader: r((slice(None),))
            else:
                plain.append((name, ckpt.shape(name), reader))
    bar = tqdm(total=len(names), desc="loading weights", disable=not progress or rank != 0, unit="tensor")
    unused = []
    try:
        done, leftovers = quant_load.pack_quantized(model, quant, quantized, dtype) if quant else ({}, {})
        packed = quant_load.packed_parameters(model)
        bar.update(len(names) - len(plain) - sum(map(len, leftovers.values())))
        for p in model.parameters():
            if id(p) not in packed:
                p.data.fill_(float("nan"))  # anything the checkpoint does not fill shows up below
        for name, shape, reader in plain:
            if not model.holds(name):  # another pipeline stage's layer
                pass
            elif not model.load_weight(name, shape, reader):
                unused.append(name)
            bar.update(1)
        if leftovers:
            done["dequantised"] = done.get("dequantised", 0) + quant_load.load_dequantized(model, quant, leftovers)
            bar.update(sum(map(len, leftovers.values())))
        if quant:
            log.info("%s checkpoint: %d quantised linears loaded (rank %d: %s)", quant.method, len(quantized), rank,
                     ", ".join(f"{n} {how}" for how, n in sorted(done.items())) or "none used")
    finally:
        for ckpt in checkpoints:
            ckpt.close()
    bar.close()
    missing = [n for n, p in model.named_parameters() if id(p) not in packed and torch.isnan(p).any()]
    if missing:
        raise ValueError(f"the checkpoint does not fill {len(missing)} parameters, e.g. {missing[:3]}")
    if unused:
        log.warning("unused checkpoint tensors: %s", unused[:5])
