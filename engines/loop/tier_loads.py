"""The KV tiers from the scheduler's side (docs/kv-tiers.md): which blocks go down, which come back.

    saves()                the blocks cached since the last call (write-through): the next
                           operation that may write the pool writes them down the tiers first
    before_schedule(s)     for the waiting requests the next step could admit: their blocks after
                           the device prefix hit that rank 0's tiers hold → adopted into the pool
                           (cached, unreferenced) → loaded by every rank → the scheduler's lookup
                           finds them as a prefix hit; a block some rank could not load is forgotten
                           and recomputed

Loading before the plan, not inside it, is what keeps a refused block (torn, foreign) from ever
being read: the scheduler only sees blocks every rank has loaded.
"""

from __future__ import annotations

import itertools
import os
import shutil

from engines.config import SchedulerConfig, memory_bytes
from engines.core.block_manager import BlockManager
from engines.core.plan import BlockRef
from engines.core.scheduler import Scheduler
from engines.worker.kv_tiers import KvTierSettings
from engines.worker.mirror import LoadBlocks, Mirrored


def tier_settings(sched: SchedulerConfig, num_ranks: int, available_ram: int) -> KvTierSettings | None:
    """Each rank's share of option.kv_offload_memory and option.kv_offload_disk (a fraction: of the
    RAM available, of the disk tier's free space); None when neither tier is asked for."""
    if not sched.kv_offload_memory and not sched.kv_offload_dir:
        return None
    memory = memory_bytes(sched.kv_offload_memory, available_ram) // num_ranks if sched.kv_offload_memory else 0
    disk = 0
    if sched.kv_offload_dir:
        os.makedirs(sched.kv_offload_dir, exist_ok=True)
        disk = memory_bytes(sched.kv_offload_disk, shutil.disk_usage(sched.kv_offload_dir).free) // num_ranks
    return KvTierSettings(sched.kv_offload_memory_dir, memory, sched.kv_offload_dir, disk)


class TierLoads:
    def __init__(self, blocks: BlockManager, paged: Mirrored):
        self.blocks = blocks
        self.paged = paged
        self.tiers = paged.target.tiers  # rank 0's: what it holds stands for every rank's (a miss on one is caught)
        blocks.new_cached = []  # the block manager lists what it caches from now on
        self.num_loaded_blocks = 0
        self.num_refused_blocks = 0  # adopted, then not loaded by some rank: recomputed

    def saves(self) -> list[BlockRef]:
        return [BlockRef(block_id, *tb) for block_id, tb in self.blocks.take_new_cached()]

    def before_schedule(self, scheduler: Scheduler) -> None:
        bm = self.blocks
        room = scheduler.max_num_seqs - scheduler.num_running
        free = bm.num_free_blocks  # what the requests before this one will take, taken off
        refs: list[BlockRef] = []
        for req in itertools.islice(scheduler.waiting, max(room, 0)):
            hit, next_hash = bm.lookup(req)
            # next_hash None: all cached already, or it may not use the prefix cache
            wanted = bm.uncached_after(req, hit) if next_hash is not None else []
            n = self.tiers.held_run([tb.hash for tb in wanted]) if wanted else 0
            # leave the free blocks its other tokens need: adopted blocks are evicted first otherwise
            rest = bm.num_blocks_for(req.num_tokens - (len(hit) + n) * bm.block_size)
            n = min(n, free - rest)
            if n > 0:
                taken = bm.adopt(req, hit, wanted[:n])
                refs += [BlockRef(b, *tb) for b, tb in zip(taken, wanted)]
            free -= max(n, 0) + rest
            if free <= 0:
                break  # the requests behind it will not be admitted this step
        # a block a later request's adoption took back is that request's now: load what each holds
        refs = [r for r in refs if bm.blocks[r.block_id].hash == r.hash]
        if not refs:
            return
        sources = self.paged.call(LoadBlocks(self.saves(), refs))
        failed = [r.block_id for r, tier in zip(refs, sources) if tier is None]
        for r, tier in zip(refs, sources):
            if tier is not None:
                bm.mark_loaded(r.block_id, tier)
        bm.forget(failed)
        self.num_loaded_blocks += len(refs) - len(failed)
        self.num_refused_blocks += len(failed)

    def metrics(self, query_tokens: int) -> dict[str, float]:
        out = self.tiers.metrics()
        for tier in self.tiers.tiers:  # of the prompt tokens looked up, the share each tier's blocks spared
            hit = self.blocks.tier_hit_tokens[tier.name]
            out[f"kv_tier_{tier.name}_hit_tokens"] = hit
            out[f"kv_tier_{tier.name}_hit_rate"] = hit / query_tokens if query_tokens else 0.0
        out["kv_tiers_loaded_blocks"] = self.num_loaded_blocks
        out["kv_tiers_refused_blocks"] = self.num_refused_blocks
        return out
