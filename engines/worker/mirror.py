"""Rank 0 drives the other ranks by sending them each step operation before running it.

    rank 0:   Mirrored(target, comm).call(Decode(last_tokens))
                  → comm.send_step(msgpack of the typed op) → op.run(target)
    rank > 0: serve_steps(target, comm): receive, decode into the op's own type, op.run(target) on
              its own shard (the collectives inside keep the ranks in step)

Operations are typed messages (msgspec structs, tagged), so a rank decodes exactly the fields and
types an operation declares: only plain data crosses (token ids, block ids, the scheduler's plan),
never pickled objects and never a method name.
"""

from __future__ import annotations

import logging
from typing import Union

import msgspec

from engines.core.plan import BlockRef, StepPlan
from engines.dist import STOP, Communicator
from engines.worker.kv_tiers import KvTierSettings

log = logging.getLogger(__name__)


class WarmUp(msgspec.Struct, tag="warm_up"):
    """One prefill before serving (CUDA: the profiling forward)."""

    num_tokens: int

    def run(self, target):
        return target.warm_up(self.num_tokens)


# -- the paged engine's operations (PagedRunner) ------------------------------------------------
class Allocate(msgspec.Struct, tag="allocate"):
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str
    decode_mode: str = "eager"
    compile_cache_dir: str | None = None
    step_kind: str = "one"  # engines/worker/step_kinds.py
    tiers: KvTierSettings | None = None  # each rank's KV tiers (docs/kv-tiers.md)

    def run(self, target):
        return target.allocate(self.num_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens,
                               self.attention_backend, self.decode_mode, self.compile_cache_dir, self.step_kind,
                               self.tiers)


class WarmUpBuckets(msgspec.Struct, tag="warm_up_buckets"):
    def run(self, target):
        return target.warm_up_buckets()


class Execute(msgspec.Struct, tag="execute"):
    """A plan's step (one that computes nothing still carries finished ids); pipelined: launched
    before the step before it resolves."""

    plan: StepPlan
    pipelined: bool = False

    def run(self, target):
        return target.execute(self.plan, self.pipelined)


class LoadBlocks(msgspec.Struct, tag="load_blocks"):
    """Blocks the KV tiers hold, into the pool before the next plan (the blocks cached since the
    last plan are written down first: the pool may reuse them now)."""

    saves: list[BlockRef]
    loads: list[BlockRef]

    def run(self, target):
        return target.load_blocks(self.saves, self.loads)


class Flush(msgspec.Struct, tag="flush"):
    """Resolve the step still in flight (pipelined)."""

    def run(self, target):
        return target.flush()


class RegisterLora(msgspec.Struct, tag="register_lora"):
    """A LoRA adapter registered at run time: every rank reads and keeps it."""

    name: str
    path: str

    def run(self, target):
        return target.runner.register_lora(self.name, self.path)


class UnregisterLora(msgspec.Struct, tag="unregister_lora"):
    name: str

    def run(self, target):
        return target.runner.unregister_lora(self.name)


class ActivateLora(msgspec.Struct, tag="activate_lora"):
    """An adapter into a slot: pinned ones, and the padded engine's (the paged scheduler's loads travel
    in its plan)."""

    slot: int
    name: str

    def run(self, target):
        return target.runner.activate_lora(self.slot, self.name)


# -- the padded engine's operations (PaddedBatch) -----------------------------------------------
class Prefill(msgspec.Struct, tag="prefill"):
    prompts: list[list[int]]
    prompt_top_n: list[int | None] = []  # per prompt: its log-probs with this many alternatives, or None
    lora_slots: list[int] = []  # per prompt: its LoRA adapter's slot (0: the base model); empty: all base

    def run(self, target):
        return target.prefill(self.prompts, self.prompt_top_n, self.lora_slots)


class Merge(msgspec.Struct, tag="merge"):
    keep: list[int]

    def run(self, target):
        return target.merge(self.keep)


class Decode(msgspec.Struct, tag="decode"):
    last_tokens: list[int]

    def run(self, target):
        return target.decode(self.last_tokens)


class Retire(msgspec.Struct, tag="retire"):
    keep: list[int]

    def run(self, target):
        return target.retire(self.keep)


StepOp = Union[WarmUp, Allocate, WarmUpBuckets, Execute, LoadBlocks, Flush, RegisterLora, UnregisterLora, ActivateLora, Prefill,
               Merge, Decode, Retire]
_decoder = msgspec.msgpack.Decoder(StepOp)
_encoder = msgspec.msgpack.Encoder()


class Mirrored:
    def __init__(self, target, comm: Communicator):
        self.target = target
        self.comm = comm

    def call(self, op: StepOp):
        if self.comm.world_size > 1:
            self.comm.send_step(_encoder.encode(op))
        return op.run(self.target)

    def send_others(self, op: StepOp) -> None:
        """Run `op` on the other ranks only (rank 0 ran its part already)."""
        self.comm.send_step(_encoder.encode(op))

    def stop(self) -> None:
        if self.comm.world_size > 1:
            self.comm.send_step(STOP)

    def __getattr__(self, name: str):  # attributes that are not step operations (reads only)
        return getattr(self.target, name)


def serve_steps(target, comm: Communicator) -> None:
    """Ranks > 0: run rank 0's operations until it sends STOP."""
    while True:
        data = comm.receive_step()
        if data == STOP:
            return
        _decoder.decode(data).run(target)
