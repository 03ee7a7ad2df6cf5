"""Column- and row-parallel linear layers (plain linear layers at TP=1).

    column parallel: W [out, in] split by rows    → each rank computes a slice of the outputs
    row parallel:    W [out, in] split by columns → partial sums, one all-reduce gives the output

Weights load through `load_shard`, which reads only this rank's slice of a checkpoint tensor
(`get` takes a slice tuple, so safetensors can read just those bytes).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from engines.dist import Communicator

SliceReader = Callable[[tuple], torch.Tensor]  # reads checkpoint_tensor[slices]


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b). `weight` is a tensor, or a module that multiplies x by itself: a packed low-bit
    weight (engines/layers/quant.py, option.quantize) or a CPU kernel's (engines/layers/cpu_linear.py)."""
    if not isinstance(weight, torch.Tensor):
        y = weight(x)
        return y if bias is None else y + bias
    return nn.functional.linear(x, weight, bias)


def add_lora(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """option.enable_lora: y, the linear `module`'s output for x, with each row's LoRA delta added
    (engines/layers/lora.py's hook, kept in its __dict__, outside the module tree); y as it is when
    the module has none or no row uses an adapter."""
    hook = module.__dict__.get("lora")
    return hook.add(x, y) if hook is not None else y


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    if size % world:
        raise ValueError(f"dimension {size} does not split evenly over {world} ranks")
    part = size // world
    return rank * part, (rank + 1) * part


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) for this rank's output slice. `output_sizes` lists fused parts (q, k, v),
    each split over the ranks on its own, so a fused weight loads part by part."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], comm: Communicator, *, bias: bool = False,
                 local_sizes: Sequence[int] | None = None):
        super().__init__()
        self.comm = comm
        self.part_sizes = list(local_sizes or [s // comm.world_size for s in output_sizes])
        out = sum(self.part_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load_shard(self, part: int, full_size: int, get: SliceReader, which: str = "weight",
                   rows: tuple[int, int] | None = None) -> None:
        """Copy this rank's rows of fused part `part` (or the given `rows` of it) from the checkpoint."""
        start = sum(self.part_sizes[:part])
        lo, hi = rows or shard_range(full_size, self.comm.rank, self.comm.world_size)
        assert hi - lo == self.part_sizes[part], (lo, hi, self.part_sizes[part])
        target = self.weight if which == "weight" else self.bias
        target.data[start:start + hi - lo].copy_(get((slice(lo, hi),)))

    def load_fused(self, full_sizes: Sequence[int], get: SliceReader, which: str = "weight",
                   rows: Sequence[tuple[int, int] | None] = ()) -> None:
        """A checkpoint tensor holding every part, concatenated (Phi-3's qkv_proj, gate_up_proj):
        each part's rows of this rank, as load_shard reads a part stored alone."""
        offset = 0
        for part, size in enumerate(full_sizes):
            def reader(index, at=offset):
                return get((slice(at + index[0].start, at + index[0].stop),) + tuple(index[1:]))
            self.load_shard(part, size, reader, which, rows[part] if part < len(rows) else None)
            offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_lora(self, x, linear(x, self.weight, self.bias))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) (+ b): input features split over the ranks."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, *, bias: bool = False):
        super().__init__()
        self.comm = comm
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // comm.world_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_shard(self, get: SliceReader, which: str = "weight") -> None:
        if which == "bias":
            self.bias.data.copy_(get((slice(None),)))
            return
        lo, hi = shard_range(self.in_features, self.comm.rank, self.comm.world_size)
        self.weight.data.copy_(get((slice(None), slice(lo, hi))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(add_lora(self, x, linear(x, self.weight)))  # this rank's LoRA part joins it
        return y + self.bias if self.bias is not None else y
