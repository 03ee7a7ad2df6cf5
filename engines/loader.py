"""Load HF safetensors checkpoints (one file, or sharded with an index) into our model code.

Each rank reads only its slices (`safe_open(...).get_slice(name)[slices]` reads just those bytes),
so a rank's peak memory is about its shard.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str, hf_config) -> torch.dtype:
    """`option.dtype` → torch dtype; `auto` takes the checkpoint's (float32 when it names none)."""
    if name != "auto":
        return TORCH_DTYPES[name]
    declared = getattr(hf_config, "dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    return getattr(torch, str(declared or "float32").replace("torch.", ""), torch.float32)


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


def build_model(cls, hf_config, comm, dtype: torch.dtype, device: torch.device, max_positions: int,
                progress: bool = True):
    """Construct `cls` with empty weights in `dtype` on `device` and fill them from the checkpoint."""
    from tqdm import tqdm

    started = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, comm, max_positions)
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():
        p.data.fill_(float("nan"))  # anything the checkpoint does not fill shows up below
    files = checkpoint_files(hf_config._name_or_path)
    names = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names += [(path, k) for k in f.keys()]
    bar = tqdm(total=len(names), desc="loading weights", disable=not progress or comm.rank != 0, unit="tensor")
    unused = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if not model.load_weight(name, list(sl.get_shape()), lambda idx, sl=sl: sl[idx]):
                    unused.append(name)
                bar.update(1)
    bar.close()
    missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise ValueError(f"the checkpoint does not fill {len(missing)} parameters, e.g. {missing[:3]}")
    if unused:
        log.warning("unused checkpoint tensors: %s", unused[:5])
    log.info("loaded %d tensors from %d file(s) in %.1f s (rank %d)", len(names), len(files),
             time.perf_counter() - started, comm.rank)
    return model.eval()
