"""Communication between tensor-parallel ranks, below both the layers and the worker.

`Communicator` is the small interface the rest of the engine uses:
- `SingleProcess`: TP=1, every collective is the identity;
- `MpiCommunicator`: mpi4py over MPI.COMM_WORLD, for ranks on CPUs (about 10 µs for a 4096-float
  all-reduce here, against about 1 ms with gloo);
- `TorchDistCommunicator`: torch.distributed with NCCL, one GPU per rank, for the collectives (gloo runs
  the same code on CPU ranks in the tests); its plans (and barriers) go over MPI on the CPU.

`rank_info` is the one place that maps OpenMPI's environment to world size / rank / local rank.
Rank 0 sends each step's plan with `send_step`; ranks > 0 wait for it in `receive_step`, polling
politely so an idle rank does not spin a core.

Pipeline parallelism (option.pipeline_parallel_degree, docs/multinode.md): the world's ranks are
`stages` groups of `tp` consecutive ranks (stage s: ranks s*tp .. s*tp+tp-1), each stage holding a
contiguous run of the decoder layers. The engine keeps the world communicator (plans, barriers,
rank 0's broadcasts); the model gets `comm.tp`, its stage's communicator for the collectives inside
the layers, whose `pipeline` (`Pipeline`; None without pipeline parallelism) passes the hidden states
to the next stage and the last stage's logits back to rank 0, which samples.
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


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers stage `stage` of `stages` holds: an even split, the first stages taking one
    more where it does not divide (the last stage also runs the LM head)."""
    if num_layers < stages:
        raise ValueError(f"option.pipeline_parallel_degree={stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class Communicator(Protocol):
    rank: int
    world_size: int
    tp: "Communicator"  # the collectives inside the model: this rank's stage (itself without pipeline parallelism)
    pipeline: "Pipeline | None"  # on `tp`: the hand-over between stages (None: one stage)

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

    def close(self) -> None:
        """Before the process exits: end what runs beside the interpreter (torch.distributed's groups)."""


class SingleProcess:
    rank = 0
    world_size = 1
    pipeline = None

    @property
    def tp(self) -> "SingleProcess":
        return self

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

    def close(self) -> None:
        pass


class MpiCommunicator:
    """Collectives in float32 numpy buffers (MPI has no bfloat16); results cast back."""

    POLL_S = 0.0005

    def __init__(self, tp: int | None = None, comm=None):
        """The world's communicator (`comm` None), with its ranks in stages of `tp` (None: one stage)."""
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.pipeline: Pipeline | None = None
        self.tp = self
        if comm is None and tp is not None and tp < self.world_size:
            if self.world_size % tp:
                raise ValueError(f"{self.world_size} ranks do not form stages of tensor_parallel_degree={tp}")
            self.tp = MpiCommunicator(comm=self.comm.Split(self.rank // tp, self.rank))
            self.tp.pipeline = Pipeline(self, tp)

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
        self._wait(self.comm.Ibarrier())

    def _wait(self, req) -> None:
        while not req.Test():
            time.sleep(self.POLL_S)

    def send(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Point to point; bfloat16 travels as its 16-bit pattern (MPI has no bfloat16)."""
        buf = tensor.detach().cpu().contiguous()
        if buf.dtype == torch.bfloat16:
            buf = buf.view(torch.int16)
        self._wait(self.comm.Isend(buf.numpy(), dest=dest, tag=tag))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, source: int,
             tag: int = 0) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        view = out.view(torch.int16) if dtype == torch.bfloat16 else out
        self._wait(self.comm.Irecv(view.numpy(), source=source, tag=tag))
        return out.to(device)

    def send_step(self, data: bytes) -> None:
        import numpy as np

        size = np.array([len(data)], dtype=np.int64)
        self.comm.Ibcast(size, root=0).Wait()
        if data:
            self.comm.Bcast(np.frombuffer(data, dtype=np.uint8).copy(), root=0)

    def close(self) -> None:
        pass  # mpi4py finalises MPI itself at exit

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


class Pipeline:
    """The hand-over between pipeline stages, over the world's communicator: each rank sends its stage's
    output (the hidden states and the residual stream, every TP rank holding all of them) to the rank
    of the same TP index in the next stage; the last stage's TP rank 0 sends the logits to rank 0.
    Receivers poll (an idle stage sleeps instead of spinning a core while the stages before it run)."""

    def __init__(self, world: MpiCommunicator, tp: int):
        self.world = world
        self.tp_size = tp
        self.count = world.world_size // tp  # stages
        self.index = world.rank // tp  # this rank's stage
        self.is_first, self.is_last = self.index == 0, self.index == self.count - 1
        self.world_rank, self.world_size = world.rank, world.world_size

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.count, self.index)

    def send_forward(self, *tensors: torch.Tensor) -> None:
        """To the next stage (same shapes and dtype on both sides)."""
        for i, t in enumerate(tensors):
            self.world.send(t, self.world_rank + self.tp_size, tag=i)

    def recv_forward(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     count: int = 2) -> list[torch.Tensor]:
        return [self.world.recv(shape, dtype, device, self.world_rank - self.tp_size, tag=i) for i in range(count)]

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's TP rank 0 → rank 0 (itself with one stage)."""
        self.world.send(logits, 0, tag=0)

    def recv_logits(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return self.world.recv(shape, torch.float32, device, self.world_size - self.tp_size, tag=0)


class TorchDistCommunicator:
    """torch.distributed for the collectives of a step and the hand-overs between pipeline stages: NCCL
    on GPUs (one per rank); gloo runs the same code on CPU ranks (the tests). The plans and barriers go
    over MPI on the CPU (the ranks run under mpirun anyway), where an idle rank polls a non-blocking
    broadcast instead of sitting in an NCCL collective that times out after minutes without requests.
    The rendezvous is MASTER_ADDR:MASTER_PORT (the launcher sets them: the hostfile's first host, one
    port per copy), else 127.0.0.1:29511.

    One instance per group: the world's (`start`), and with pipeline parallelism one per stage (`tp`),
    whose collectives run in its torch process group; `root` is its rank 0's rank in the world."""

    def __init__(self, dist, plans: MpiCommunicator, rank: int, world_size: int, group=None, root: int = 0):
        self._dist, self._plans = dist, plans
        self.rank, self.world_size = rank, world_size
        self.group, self.root = group, root
        self.tp: TorchDistCommunicator = self
        self.pipeline: Pipeline | None = None

    @classmethod
    def start(cls, info: RankInfo, backend: str, tp: int | None = None) -> "TorchDistCommunicator":
        import os

        import torch.distributed as dist

        from engines.process.rundir import DIST_PORT

        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", DIST_PORT))
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", world_size=info.world_size,
                                rank=info.rank)
        world = cls(dist, MpiCommunicator(), info.rank, info.world_size)
        if tp is not None and tp < info.world_size:
            if info.world_size % tp:
                raise ValueError(f"{info.world_size} ranks do not form stages of tensor_parallel_degree={tp}")
            # every rank makes every stage's group, in the same order (torch.distributed's rule)
            groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(info.world_size // tp)]
            stage = info.rank // tp
            world.tp = cls(dist, world._plans, info.rank % tp, tp, groups[stage], stage * tp)
            world.tp.pipeline = Pipeline(world, tp)
        return world

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(tensor, group=self.group)
        return tensor

    def close(self) -> None:
        """Destroy the process groups (their worker threads joined): a gloo thread left running at exit
        can touch a Python object while the interpreter finalises and abort the process (seen once in
        three suite runs: `terminate called without an active exception` in ProcessGroupGloo::runLoop)."""
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        self._dist.gather(tensor.contiguous(), parts, dst=self.root, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.broadcast(tensor, src=self.root, group=self.group)
        return tensor

    def send(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Point to point in the world (the stages' hand-overs; NCCL keeps each pair's order)."""
        self._dist.send(tensor.contiguous(), dst=dest, tag=tag)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, source: int,
             tag: int = 0) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        self._dist.recv(out, src=source, tag=tag)
        return out

    def barrier(self) -> None:
        self._plans.barrier()

    def send_step(self, data: bytes) -> None:
        self._plans.send_step(data)

    def receive_step(self) -> bytes:
        return self._plans.receive_step()


def make_communicator(info: RankInfo, tp: int | None = None, backend: str | None = None) -> Communicator:
    """tp: the ranks of one pipeline stage (None or the world size: no pipeline parallelism). backend:
    "nccl" (the default with CUDA), "mpi" (without), or "gloo" (torch.distributed on CPU ranks: the
    GPU path's code, run by the tests)."""
    if info.world_size == 1:
        return SingleProcess()
    backend = backend or ("nccl" if torch.cuda.is_available() else "mpi")
    if backend == "mpi":
        return MpiCommunicator(tp)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    return TorchDistCommunicator.start(info, backend, tp)
