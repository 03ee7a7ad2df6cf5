"""Where the engine runs: the tensor-parallel degree, the model copies and what each holds (GPUs by
CUDA_VISIBLE_DEVICES' numbering, or an equal share of this process's cores), and what the GPUs are,
asked without importing torch (the launcher stays light). The environment comes in as an argument.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Mapping

from container.keys import ConfigError
from container.merge import ResolvedConfig
from engines.config import ParallelConfig

log = logging.getLogger("container.config")


class CapacityError(ConfigError):
    """The configuration asks for more devices than this machine has."""


def resolve_tensor_parallel(cfg: ResolvedConfig, num_gpus: int, num_cpus: int) -> int:
    tp = cfg["option.tensor_parallel_degree"]
    if tp == "max":
        if num_gpus == 0:
            log.info("option.tensor_parallel_degree=max on a machine without GPUs: using 1")
            return 1
        return num_gpus
    limit, what = (num_gpus, "GPUs") if num_gpus else (num_cpus, "CPU cores")
    if tp > limit:
        raise CapacityError(f"option.tensor_parallel_degree={tp} exceeds the {limit} {what} of this machine; "
                          f"set it to {limit} or less (or max)")
    return tp


def model_copies(cfg: ResolvedConfig, use_mpi: bool, tp: int, num_gpus: int, num_cpus: int) -> int:
    """maxWorkers, else minWorkers, else DJL's default: #GPUs / TP under MPI on GPUs, else one; more copies
    than the devices (on CPU: cores) hold is a ConfigError."""
    low, high = cfg["minWorkers"], cfg["maxWorkers"]
    if low is not None and high is not None and low > high:
        raise ConfigError(f"minWorkers={low} exceeds maxWorkers={high}")
    asked = high if high is not None else low
    limit, what = (num_gpus // tp, f"{num_gpus} GPUs") if num_gpus else (num_cpus // tp, f"{num_cpus} CPU cores")
    if asked is None:
        return max(1, limit) if use_mpi and num_gpus else 1
    if asked > max(limit, 1):
        raise CapacityError(f"maxWorkers={asked}: this machine's {what} hold at most {max(limit, 1)} copies of "
                            f"tensor_parallel_degree={tp}; lower maxWorkers (or minWorkers)")
    return asked


def placement(cfg: ResolvedConfig, use_mpi: bool, tp: int, num_gpus: int, num_cpus: int,
              pp: int = 1, env: Mapping[str, str] | None = None) -> ParallelConfig:
    """The copies and what each holds: GPU copy i the devices i*TP ... i*TP+TP-1 (as CUDA_VISIBLE_DEVICES
    numbers them in `env`, DJL's rule), CPU copy i an equal share of this process's cores."""
    hosts = dict(hostfile=cfg["option.mpi_hostfile"], rsh_agent=cfg["option.mpi_rsh_agent"],
                 network=cfg["option.mpi_network"], pipeline_parallel_degree=pp)
    if hosts["hostfile"] and not use_mpi:
        raise ConfigError("option.mpi_hostfile needs engine=MPI with option.tensor_parallel_degree > 1 (the ranks "
                          "it spreads over the hosts)")
    copies = model_copies(cfg, use_mpi, tp * pp, num_gpus, num_cpus)
    if copies > 1 and cfg["option.enable_lora"]:
        raise ConfigError(f"maxWorkers={copies} with option.enable_lora=true: not supported together yet (adapters "
                          "are registered with one engine); serve LoRA adapters with one copy")
    if copies > 1 and hosts["hostfile"]:
        raise ConfigError(f"maxWorkers={copies} with option.mpi_hostfile: one copy spans the hosts")
    if copies == 1:
        return ParallelConfig(use_mpi=use_mpi, tensor_parallel_degree=tp, **hosts)
    if num_gpus:
        visible = [d.strip() for d in (env or {}).get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
            [str(i) for i in range(num_gpus)]
        return ParallelConfig(use_mpi=use_mpi, tensor_parallel_degree=tp, copies=copies,
                              copy_devices=[visible[i * tp:(i + 1) * tp] for i in range(copies)])
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(num_cpus))
    share = len(cores) // copies
    return ParallelConfig(use_mpi=use_mpi, tensor_parallel_degree=tp, copies=copies,
                          copy_cores=[cores[i * share:(i + 1) * share] for i in range(copies)])


def count_gpus(env: Mapping[str, str]) -> int:
    """NVIDIA GPUs visible to this process, without importing torch (the launcher stays light)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    try:
        present = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    if visible is None:
        return present
    listed = [d for d in visible.split(",") if d.strip()]
    if "-1" in [d.strip() for d in listed[:1]]:
        return 0
    return min(present, len(listed))


def query_gpus(field: str) -> list[str] | None:
    """One nvidia-smi field per GPU (`--query-gpu=FIELD`, no header or units), without importing torch;
    None when nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        return subprocess.run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_memory_bytes(num_gpus: int) -> int:
    """The memory of the smallest of the first `num_gpus` GPUs (0 without GPUs, or when nvidia-smi cannot say)."""
    mib = [int(v) for v in (query_gpus("memory.total") or [])[:num_gpus]] if num_gpus else []
    return min(mib) * 2**20 if mib else 0


def gpu_supports_bf16() -> bool | None:
    """Whether every visible NVIDIA GPU computes bf16 (compute capability 8.0+: A100, A10G, L4, H100, ...);
    None when it cannot say."""
    caps = query_gpus("compute_cap")
    if not caps:
        return None
    try:
        return all(float(cap) >= 8.0 for cap in caps)
    except ValueError:
        return None
