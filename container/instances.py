"""SageMaker GPU instance types that LMI is deployed on: GPU count and memory per GPU.

From the public instance specifications (AWS "Amazon EC2 accelerated computing instances"):
g5 = NVIDIA A10G 24 GiB, g6 = NVIDIA L4 24 GiB, g6e = NVIDIA L40S 48 GiB, p4d = A100 40 GiB,
p4de = A100 80 GiB, p5 = H100 80 GiB. The memory is the nominal size; what CUDA can hand out is a
little less, which gpu_memory_utilization (0.9 by default) leaves room for.
"""

from __future__ import annotations

from engines.weights.memory_plan import GIB, Machine

# name -> (number of GPUs, GiB per GPU)
INSTANCES: dict[str, tuple[int, int]] = {
    **{f"ml.g5.{size}": (1, 24) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g5.12xlarge": (4, 24), "ml.g5.24xlarge": (4, 24), "ml.g5.48xlarge": (8, 24),
    **{f"ml.g6.{size}": (1, 24) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g6.12xlarge": (4, 24), "ml.g6.24xlarge": (4, 24), "ml.g6.48xlarge": (8, 24),
    **{f"ml.g6e.{size}": (1, 48) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g6e.12xlarge": (4, 48), "ml.g6e.24xlarge": (4, 48), "ml.g6e.48xlarge": (8, 48),
    "ml.p4d.24xlarge": (8, 40),
    "ml.p4de.24xlarge": (8, 80),
    "ml.p5.48xlarge": (8, 80),
}


def instance(name: str) -> Machine:
    """The machine of a SageMaker instance type ("ml." may be left out); ValueError names the known ones."""
    key = name if name.startswith("ml.") else "ml." + name
    if key not in INSTANCES:
        raise ValueError(f"unknown instance type {name!r}; known: {', '.join(INSTANCES)}")
    gpus, gib = INSTANCES[key]
    return Machine(key, gpus, gib * GIB)


def gpus(num_gpus: int, gib: float) -> Machine:
    return Machine(f"{num_gpus} x {gib:g} GiB GPUs", num_gpus, int(gib * GIB))
