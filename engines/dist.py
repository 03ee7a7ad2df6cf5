"""Communication between tensor-parallel ranks, below both the layers and the worker.

`Communicator` is the small interface the rest of the engine uses:
- `SingleProcess`: TP=1, every collective is the identity;
- `MpiCommunicator`: mpi4py over MPI.COMM_WORLD, for ranks on CPUs (about 10 µs for a 4096-float
  all-reduce here, against about 1 ms with gloo);
- `NcclCommunicator`: torch.distributed with NCCL, one GPU per rank, for the collectives; its plans
  (and barriers) go over MPI on the CPU.

`rank_info` is the one place that maps OpenMPI's environment to world size / rank / local rank.
Rank 0 sends each step's plan with `send_step`; ranks > 0 wait for it in `receive_step`, polling
politely so an idle rank does not spin a core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

STOP = b""  # the step message that tells ranks > 0 to exit


@dataclass(frozen=True)
class RankInfo:
    world_size: int
    rank: int
    local_rank: int


def rank_info(env: Mapping[str, str]) -> RankInfo:
    """OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_RANK}, or a single process when not under mpirun."""
    return RankInfo(int(env.get("OMPI_COMM_WORLD_SIZE", "1")), int(env.get("OMPI_COMM_WORLD_RANK", "0")),
                    int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns the summed tensor (same dtype)."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor concatenated along `dim`, in rank order."""

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0: every rank's tensor concatenated along `dim`, in rank order; other ranks: None."""

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (the others pass one of the same shape and dtype)."""

    def barrier(self) -> None:
        """Wait until every rank gets here (all ranks loaded: rank 0 may say ready)."""

    def send_step(self, data: bytes) -> None:
        """Rank 0: hand this step's plan to the other ranks."""

    def receive_step(self) -> bytes:
        """Ranks > 0: the next plan from rank 0 (STOP to exit)."""


class SingleProcess:
    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def send_step(self, data: bytes) -> None:
        pass

    def receive_step(self) -> bytes:
        raise RuntimeError("a single process has no rank 0 to wait for")


class MpiCommunicator:
    """Collectives in float32 numpy buffers (MPI has no bfloat16); results cast back."""

    POLL_S = 0.0005

    def __init__(self):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = tensor.detach().to(torch.float32).contiguous()
        self.comm.Allreduce(self._mpi.IN_PLACE, buf.numpy(), op=self._mpi.SUM)
        return buf.to(tensor.dtype)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        buf = tensor.detach().to(torch.float32).contiguous()
        out = torch.empty((self.world_size, *buf.shape), dtype=torch.float32)
        self.comm.Allgather(buf.numpy(), out.numpy())
        return torch.cat(out.unbind(0), dim=dim).to(tensor.dtype)

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        buf = tensor.detach().to(torch.float32).contiguous()
        out = torch.empty((self.world_size, *buf.shape), dtype=torch.float32) if self.rank == 0 else None
        self.comm.Gather(buf.numpy(), out.numpy() if out is not None else None, root=0)
        return torch.cat(out.unbind(0), dim=dim).to(tensor.dtype) if out is not None else None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = tensor.detach().cpu().contiguous()
        self.comm.Bcast(buf.numpy(), root=0)
        return buf.to(tensor.device)

    def barrier(self) -> None:
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(self.POLL_S)

    def send_step(self, data: bytes) -> None:
        import numpy as np

        size = np.array([len(data)], dtype=np.int64)
        self.comm.Ibcast(size, root=0).Wait()
        if data:
            self.comm.Bcast(np.frombuffer(data, dtype=np.uint8).copy(), root=0)

    def receive_step(self) -> bytes:
        import numpy as np

        size = np.zeros(1, dtype=np.int64)
        req = self.comm.Ibcast(size, root=0)
        while not req.Test():  # a waiting rank sleeps instead of spinning in MPI's progress loop
            time.sleep(self.POLL_S)
        if not size[0]:
            return STOP
        buf = np.empty(int(size[0]), dtype=np.uint8)
        self.comm.Bcast(buf, root=0)
        return buf.tobytes()


class NcclCommunicator:
    """torch.distributed over NCCL (one GPU per rank) for the collectives of a step; the plans go
    over MPI on the CPU (the ranks run under mpirun anyway), where an idle rank polls a
    non-blocking broadcast instead of sitting in an NCCL collective that times out after minutes
    without requests."""

    def __init__(self, info: RankInfo, master_addr: str = "127.0.0.1", master_port: int = 29511):
        import torch.distributed as dist

        self._plans = MpiCommunicator()
        self._dist = dist
        dist.init_process_group("nccl", init_method=f"tcp://{master_addr}:{master_port}",
                                world_size=info.world_size, rank=info.rank)
        self.rank, self.world_size = info.rank, info.world_size
        self.device = torch.device("cuda", torch.cuda.current_device())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        self._dist.gather(tensor.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.broadcast(tensor, src=0)
        return tensor

    def barrier(self) -> None:
        self._plans.barrier()

    def send_step(self, data: bytes) -> None:
        self._plans.send_step(data)

    def receive_step(self) -> bytes:
        return self._plans.receive_step()


def make_communicator(info: RankInfo) -> Communicator:
    if info.world_size == 1:
        return SingleProcess()
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        return NcclCommunicator(info)
    return MpiCommunicator()
