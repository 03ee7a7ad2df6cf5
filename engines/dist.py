"""Communication between tensor-parallel ranks, below both the layers and the worker.

`Communicator` is the small interface the rest of the engine uses. `SingleProcess` is the TP=1
case (every collective is the identity); the MPI/NCCL implementations plug in behind the same
interface.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place where possible); returns the summed tensor."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along `dim`, in rank order."""

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (ranks > 0 pass None)."""


class SingleProcess:
    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        assert data is not None
        return data
