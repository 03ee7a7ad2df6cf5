"""KV-cache blocks of the paged engine: ref counts, an LRU free list, prefix caching (pure Python: no torch).

The cache is `num_blocks` blocks of `block_size` token slots. A request's block table maps its
positions to slots:

    block_size = 4, req.block_ids = [7, 2, 9]
    position p:  0  1  2  3 | 4  5  6  7 | 8  9
    block:       7            2            9 (partial: never shared)
    slot(p) = block_ids[p // block_size] * block_size + p % block_size

Prefix caching: once a block is full and computed, it is registered under a chained hash,
hash_i = hash((hash_{i-1}, tokens of block i)), so one hash stands for the whole prefix up to it.
A later request whose first blocks hash the same takes refs on those blocks instead of computing
them. A hit is confirmed by comparing the block's parent hash and tokens, so a hash collision never
shares K/V. A freed block keeps its hash (it can still be hit) until the free list hands it out
again; the free list is least recently freed first, so the least recently used prefix is evicted.

The hash is a digest of the parent and the tokens, the same in every process (not Python's
per-process `hash`): the KV tiers below the pool (engines/worker/kv_tiers.py, docs/kv-tiers.md)
name blocks by it, across copies and restarts. With tiers on, every block as it is first cached
is listed in `new_cached` (the engine writes it down a tier: write-through), and `adopt` takes
blocks a lower tier holds back into the pool as cached, unreferenced blocks, so that the
scheduler's lookup finds them like any other prefix hit.

Sliding window (a model whose every layer attends to at most `window` keys back, Mistral-style):
a request's first blocks, once wholly behind the window of its next query, are given back to the
pool as it decodes (`release_outside_window`). Their entries stay in its block table (positions
keep their index) but are never read: the attention backends skip, or mask, keys outside the window.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from engines.core.request import Request

_TOKEN_BYTES = array("i").itemsize
class PrefixHit(NamedTuple):
    block_ids: list[int]  # cached blocks matching the start of a request's tokens
    next_hash: int | None  # prefix hash of the full block after them; None when none is left to compute


_ROOT = None  # parent hash of block 0: not an int, so it never equals a block's hash


def _root(req: Request):
    """The parent of a request's block 0: its LoRA adapter's K/V differ from the base model's for the
    same tokens, so each adapter's prefixes form their own chains (a tuple never equals a hash)."""
    return _ROOT if req.lora_name is None else ("lora", req.lora_name)


def parent_bytes(parent) -> bytes:
    """A block's parent as bytes: the hash before it (8 bytes), or its chain's root (base or adapter)."""
    if parent is None:
        return b"root"
    if isinstance(parent, int):
        return parent.to_bytes(8, "little")
    return ("lora:" + parent[1]).encode()


def hash_block(parent, tokens: bytes) -> int:
    """Chained hash of one full block, a 64-bit digest the same in every process (module level, so
    that tests can force collisions; a collision never shares K/V: `Block.holds` checks)."""
    return int.from_bytes(hashlib.blake2b(parent_bytes(parent) + tokens, digest_size=8).digest(), "little")


class TierBlock(NamedTuple):
    """A full block as the KV tiers name it: its hash, and the parent and tokens that a tier checks
    before loading it (a collision or a foreign file never loads)."""

    hash: int
    parent: bytes  # parent_bytes of its parent
    tokens: bytes  # pack_tokens of its token ids


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """A block's token ids as int32 bytes: what the prefix index keeps per block. The index grows
    as blocks are first registered; with tuples of ints a full index of 62,500 blocks of 16 tokens
    takes 34 MiB, packed 10 MiB (tracemalloc)."""
    return array("i", tokens).tobytes()


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Block:
    __slots__ = ("block_id", "hash", "parent", "ref_count", "tokens", "tier")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.hash: int | None = None  # set while registered in the prefix cache
        self.parent: int | None = _ROOT  # hash of the block before it
        self.tokens = b""  # pack_tokens of its token ids
        self.tier: str | None = None  # the KV tier it was loaded from, until a request first takes it

    def holds(self, parent: int | None, tokens: bytes) -> bool:
        return self.parent == parent and self.tokens == tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's keys lie within this many positions (None: some layer sees all)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref 0, least recently freed first; OrderedDict: O(1) removal when a cached block is hit
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._chains: dict[str, list[int]] = {}  # request id -> hashes of its first blocks, in order
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.new_cached: list[tuple[int, TierBlock]] | None = None  # [] with KV tiers: (block id, block) cached since taken
        self.tier_hit_tokens: Counter[str] = Counter()  # tier name → prompt tokens its loaded blocks spared

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_queries_tokens if self.num_prefix_queries_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks matching the start of the request's tokens, leaving at least one token to compute."""
        return self.lookup(req).block_ids

    def lookup(self, req: Request) -> PrefixHit:
        """The cached blocks matching the start of the request's tokens, and the prefix hash of the
        full block right after them (None when no full block is left to compute or the request
        cannot use the prefix cache)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], None)
        if req.sampling.prompt_logprobs and not req.output_token_ids:
            return PrefixHit([], None)  # every prompt token's logits are needed: compute them all (once)
        tokens, size = req.all_token_ids, self.block_size
        found: list[int] = []
        parent = _root(req)
        for i in range((len(tokens) - 1) // size):
            chunk = pack_tokens(tokens[i * size:(i + 1) * size])
            h = hash_block(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or not self.blocks[block_id].holds(parent, chunk):
                return PrefixHit(found, h)
            found.append(block_id)
            parent = h
        return PrefixHit(found, None)

    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        num_new_blocks = self._num_new_blocks(req, num_new_tokens, computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return num_new_blocks + num_revived <= len(self.free_blocks)

    def allocate(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grow req.block_ids to hold num_computed_tokens (+ the computed blocks) + num_new_tokens.

        computed_blocks (from get_computed_blocks) only on a request's first allocation: they become
        its first blocks and advance req.num_computed_tokens. False, and nothing changed, when the
        free blocks do not suffice.
        """
        if computed_blocks and (req.block_ids or req.num_computed_tokens):
            raise ValueError(f"{req.request_id}: computed blocks are only taken on the first allocation")
        if not self.can_allocate(req, num_new_tokens, computed_blocks):
            return False
        num_new_blocks = self._num_new_blocks(req, num_new_tokens, computed_blocks)
        if not req.block_ids:
            self._start(req, computed_blocks)
        for _ in range(num_new_blocks):
            req.block_ids.append(self._take_free())
        return True

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Blocks an allocate(req, num_new_tokens) would take (a running request)."""
        return self._num_new_blocks(req, num_new_tokens, ())

    def trim(self, req: Request, num_slots: int) -> None:
        """Free the blocks at the end of the table past the first `num_slots` slots (speculated
        tokens that were rejected: never full of verified tokens, so never in the prefix cache)."""
        keep = self.num_blocks_for(num_slots)
        for block_id in reversed(req.block_ids[keep:]):
            if self.blocks[block_id].hash is not None:
                raise AssertionError(f"block {block_id} of {req.request_id} is cached but trimmed")
            self._unref(block_id)
        del req.block_ids[keep:]

    def append_slot(self, req: Request) -> bool:
        """Room for one more token (a decode step)."""
        return self.allocate(req, 1)

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed up to num_computed_tokens."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains.setdefault(req.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(req.block_ids))
        if len(chain) >= num_full:
            return
        tokens, size = req.all_token_ids, self.block_size
        parent = chain[-1] if chain else _root(req)
        for i in range(len(chain), num_full):
            chunk = pack_tokens(tokens[i * size:(i + 1) * size])
            h = hash_block(parent, chunk)
            block = self.blocks[req.block_ids[i]]
            # a duplicate (same prefix computed twice at once) or a collision stays unregistered; so
            # does a block already released (another request's now)
            if block.hash is None and h not in self.cached and i >= req.num_released_blocks:
                block.hash, block.parent, block.tokens = h, parent, chunk
                self.cached[h] = block.block_id
                if self.new_cached is not None:
                    self.new_cached.append((block.block_id, TierBlock(h, parent_bytes(parent), chunk)))
            chain.append(h)
            parent = h

    def uncached_after(self, req: Request, hit: Sequence[int]) -> list[TierBlock]:
        """The request's full blocks after its device hit `hit` (lookup's block ids), each named as
        a tier names it, leaving at least one token to compute: what a lower tier may hold."""
        tokens, size = req.all_token_ids, self.block_size
        parent = self.blocks[hit[-1]].hash if hit else _root(req)
        out: list[TierBlock] = []
        for i in range(len(hit), (len(tokens) - 1) // size):
            chunk = pack_tokens(tokens[i * size:(i + 1) * size])
            h = hash_block(parent, chunk)
            out.append(TierBlock(h, parent_bytes(parent), chunk))
            parent = h
        return out

    def adopt(self, req: Request, hit: Sequence[int], blocks: Sequence[TierBlock]) -> list[int]:
        """Free blocks for `blocks` (what a lower tier holds of the request's, in chain order after
        its device hit `hit`), cached and unreferenced, at the recently used end of the free list:
        the caller loads their K/V before any step reads them, or `forget`s them. The hit's own
        blocks are held meanwhile, so that adopting never evicts them."""
        parent = self.blocks[hit[-1]].hash if hit else _root(req)
        for block_id in hit:
            self._ref(block_id)
        taken: list[int] = []
        for tb in blocks:
            if not self.free_blocks or tb.hash in self.cached:
                break
            block = self.blocks[self._take_free()]
            block.hash, block.parent, block.tokens, block.ref_count = tb.hash, parent, tb.tokens, 1
            self.cached[tb.hash] = block.block_id
            taken.append(block.block_id)
            parent = tb.hash
        for block_id in taken + list(hit):
            self._unref(block_id)
        return taken

    def mark_loaded(self, block_id: int, tier: str) -> None:
        """An adopted block's K/V came from `tier` (counted as that tier's hit when a request takes it)."""
        self.blocks[block_id].tier = tier

    def forget(self, block_ids: Iterable[int]) -> None:
        """Drop cached, unreferenced blocks from the prefix cache (their K/V failed to load)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            _check(block.ref_count == 0, f"block {block_id} is held: cannot forget it")
            if block.hash is not None:
                del self.cached[block.hash]
                block.reset()
            self.free_blocks.move_to_end(block_id, last=False)  # handed out first

    def take_new_cached(self) -> list[tuple[int, TierBlock]]:
        """The blocks cached since the last call (with KV tiers), to write down a tier."""
        out = self.new_cached or []
        if self.new_cached:
            self.new_cached = []
        return out

    def free(self, req: Request) -> None:
        """Drop the request's refs, tail first: its last blocks are then the first evicted."""
        for block_id in reversed(req.block_ids[req.num_released_blocks:]):
            self._unref(block_id)
        req.block_ids = []
        req.num_released_blocks = 0
        self._chains.pop(req.request_id, None)

    def release_outside_window(self, req: Request) -> None:
        """Give back the request's first blocks that lie wholly before the window of its next query
        (at position num_computed_tokens, which only grows while it holds its blocks: a speculated
        token rolled back was never counted). Called once its computed blocks are cached."""
        if self.window is None:
            return
        first_needed = max(req.num_computed_tokens - self.window + 1, 0)  # the oldest key still attended
        num_behind = min(first_needed // self.block_size, len(req.block_ids))
        for block_id in req.block_ids[req.num_released_blocks:num_behind]:
            self._unref(block_id)
        req.num_released_blocks = max(req.num_released_blocks, num_behind)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None

    def check_invariants(self, holders: Iterable[Request] | None = None) -> None:
        """Raise AssertionError unless the books balance (holders: every request holding blocks)."""
        refs = Counter(b for r in holders for b in r.block_ids[r.num_released_blocks:]) if holders is not None else None
        for block in self.blocks:
            _check(block.ref_count >= 0, f"block {block.block_id}: ref {block.ref_count}")
            _check((block.ref_count == 0) == (block.block_id in self.free_blocks),
                   f"block {block.block_id}: ref {block.ref_count} but free={block.block_id in self.free_blocks}")
            if refs is not None:
                _check(block.ref_count == refs[block.block_id],
                       f"block {block.block_id}: ref {block.ref_count}, held by {refs[block.block_id]}")
            if block.hash is not None:
                _check(self.cached.get(block.hash) == block.block_id, f"block {block.block_id}: hash not mapped")
                _check(len(block.tokens) == self.block_size * _TOKEN_BYTES,
                       f"block {block.block_id}: cached but not full")
        for h, block_id in self.cached.items():
            _check(self.blocks[block_id].hash == h, f"hash {h} maps to block {block_id} with another hash")
        _check(len(self.free_blocks) <= self.num_blocks, "free list longer than the pool")
        _check(self.enable_prefix_caching or not self.cached, "blocks cached with prefix caching off")

    def _num_new_blocks(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> int:
        num_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        return max(0, self.num_blocks_for(num_tokens) - len(req.block_ids) - len(computed_blocks))

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _start(self, req: Request, computed_blocks: Sequence[int]) -> None:
        """First allocation (or the first after a preemption): take the prefix-cache hit."""
        for block_id in computed_blocks:
            self._ref(block_id)
            block = self.blocks[block_id]
            if block.tier is not None:
                self.tier_hit_tokens[block.tier] += self.block_size
                block.tier = None
        req.block_ids = list(computed_blocks)
        num_hit = len(computed_blocks) * self.block_size
        req.num_computed_tokens += num_hit
        req.num_cached_tokens = num_hit
        if self.enable_prefix_caching:
            self._chains[req.request_id] = [self.blocks[b].hash for b in computed_blocks]
            self.num_prefix_queries_tokens += req.num_tokens
            self.num_prefix_hit_tokens += num_hit

    def _take_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its old prefix
            del self.cached[block.hash]
            block.reset()
        block.ref_count = 1
        return block_id
