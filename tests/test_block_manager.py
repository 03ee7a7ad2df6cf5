"""BlockManager: ref counts, the LRU free list, prefix caching by chained hashes (pure Python)."""

from __future__ import annotations

import pytest

from engines.core import block_manager
from engines.core.block_manager import BlockManager
from engines.core.request import Request
from engines.sampling_params import SamplingParams

BS = 4
_ids = iter(range(10**9))


def req(tokens: list[int]) -> Request:
    n = next(_ids)
    return Request(f"r{n}", list(tokens), SamplingParams(max_new_tokens=8), frozenset({2}), n)


def computed(bm: BlockManager, r: Request, num_new: int | None = None) -> Request:
    """Schedule the whole request at once (with its prefix hit) and pretend the model computed it."""
    hit = bm.get_computed_blocks(r)
    num_new = r.num_tokens - len(hit) * bm.block_size if num_new is None else num_new
    assert bm.allocate(r, num_new, hit)
    r.num_computed_tokens += num_new
    bm.cache_full_blocks(r, r.num_computed_tokens)
    return r


def state(bm: BlockManager, *reqs: Request):
    return (list(bm.free_blocks), [b.ref_count for b in bm.blocks], dict(bm.cached),
            [(list(r.block_ids), r.num_computed_tokens, r.num_cached_tokens) for r in reqs])


def test_allocate_and_free_count_refs():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = req(range(10))
    assert bm.can_allocate(a, 10)
    assert bm.allocate(a, 10)
    assert a.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    bm.check_invariants([a])
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2)  # 12 slots: still 3 blocks
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.append_slot(a) and a.block_ids == [0, 1, 2, 3]  # slot 12 opens block 4
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants([a])


def test_free_list_is_least_recently_freed_first_tail_blocks_first():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a, b = req(range(8)), req(range(8))
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    bm.free(a)
    assert list(bm.free_blocks) == [4, 5, 1, 0]
    bm.free(b)
    assert list(bm.free_blocks) == [4, 5, 1, 0, 3, 2]
    c = req(range(12))
    bm.allocate(c, 12)
    assert c.block_ids == [4, 5, 1]


def test_hit_removes_a_free_block_from_the_middle_of_the_free_list():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(9)))  # blocks 0, 1 full and cached; block 2 partial
    bm.free(a)
    assert list(bm.free_blocks) == [3, 4, 5, 2, 1, 0]
    b = req(list(range(8)) + [99])
    assert bm.get_computed_blocks(b) == [0, 1]
    assert bm.allocate(b, 1, [0, 1])
    assert b.block_ids == [0, 1, 3]
    assert list(bm.free_blocks) == [4, 5, 2]
    bm.check_invariants([b])


def test_prefix_hit_skips_exactly_whole_cached_blocks():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prefix = list(range(100, 114))  # 3.5 blocks
    a = computed(bm, req(prefix + [1, 1]))
    b = req(prefix + [7, 7, 7])
    hit = bm.get_computed_blocks(b)
    assert hit == a.block_ids[:3]
    assert bm.allocate(b, b.num_tokens - 3 * BS, hit)
    assert b.num_computed_tokens == b.num_cached_tokens == 3 * BS
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] not in a.block_ids
    assert [bm.blocks[i].ref_count for i in a.block_ids] == [2, 2, 2, 1]
    bm.check_invariants([a, b])
    assert (bm.num_prefix_queries_tokens, bm.num_prefix_hit_tokens) == (a.num_tokens + b.num_tokens, 3 * BS)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


def test_last_partial_block_is_never_cached():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(14)))
    assert len(bm.cached) == 3
    assert bm.blocks[a.block_ids[3]].hash is None
    assert len(bm.get_computed_blocks(req(list(range(14)) + [5, 5, 5, 5]))) == 3


@pytest.mark.parametrize("length, num_hit", [(12, 2), (13, 3), (16, 3), (17, 4), (1, 0)])
def test_never_the_whole_sequence(length, num_hit):
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, req(range(20)))
    assert len(bm.get_computed_blocks(req(range(length)))) == num_hit


def test_a_hit_stops_at_the_first_differing_block():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(16)))
    tokens = list(range(16)) + [0]
    tokens[5] = 99
    assert bm.get_computed_blocks(req(tokens)) == a.block_ids[:1]
    # the same tokens at another position (another prefix) are no hit either
    assert bm.get_computed_blocks(req(list(range(4, 16)) + [0])) == []


def test_hash_collisions_share_nothing(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    x, y, z = [1] * BS, [3] * BS, [5] * BS
    a = computed(bm, req(x + y + [0]))
    assert bm.cached == {42: a.block_ids[0]}  # y's block collides with x's: left unregistered
    assert bm.get_computed_blocks(req(z + y + [0])) == []
    assert bm.get_computed_blocks(req(x + z + [0])) == a.block_ids[:1]
    # x again at position 1: same tokens, same (forced) hash, but another parent: no hit
    assert bm.get_computed_blocks(req(x + x + [0])) == a.block_ids[:1]
    bm.check_invariants([a])


def test_concurrent_duplicates_register_once():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a, b = req(range(9)), req(range(9))
    for r in (a, b):  # both scheduled before either is computed: no hit
        assert bm.get_computed_blocks(r) == []
        bm.allocate(r, 9)
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_full_blocks(r, 9)
    a_blocks = a.block_ids[:2]
    assert sorted(bm.cached.values()) == a_blocks
    bm.check_invariants([a, b])
    bm.free(b)
    bm.free(a)
    assert bm.get_computed_blocks(req(range(9))) == a_blocks


def test_freed_blocks_stay_cached_until_reused_least_recently_used_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(8)))  # blocks 0, 1: both full, both cached
    c = computed(bm, req(range(50, 58)))  # blocks 2, 3
    a_blocks, c_blocks = list(a.block_ids), list(c.block_ids)
    bm.free(a)
    bm.free(c)
    assert bm.get_computed_blocks(req(list(range(8)) + [0])) == a_blocks
    # two fresh blocks come from the never-used 4, 5; the next from a's tail (freed first)
    d = req([7] * 12)
    bm.allocate(d, 12)
    assert d.block_ids == [4, 5, a_blocks[1]]
    assert bm.get_computed_blocks(req(list(range(8)) + [0])) == a_blocks[:1]
    assert bm.get_computed_blocks(req(list(range(50, 58)) + [0])) == c_blocks
    d.num_computed_tokens = 12
    bm.append_slot(d)  # a's head next
    assert bm.get_computed_blocks(req(list(range(8)) + [0])) == []
    assert bm.get_computed_blocks(req(list(range(50, 58)) + [0])) == c_blocks
    bm.check_invariants([d])


def test_caching_off_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = computed(bm, req(range(16)))
    assert bm.cached == {} and bm.get_computed_blocks(req(range(16))) == []
    bm.free(a)
    assert bm.get_computed_blocks(req(range(16))) == []
    assert bm.num_prefix_queries_tokens == 0 and bm.prefix_hit_rate == 0.0
    bm.check_invariants([])


def test_allocate_out_of_blocks_changes_nothing():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(10)))  # 3 blocks
    b = req(range(10))
    hit = bm.get_computed_blocks(b)
    assert len(hit) == 2
    before = state(bm, a, b)
    assert not bm.can_allocate(b, 2 * BS + 2, hit)  # needs 2 more blocks, 1 free
    assert not bm.allocate(b, 2 * BS + 2, hit)
    assert state(bm, a, b) == before
    a.num_computed_tokens = 10
    assert not bm.allocate(a, 7)
    assert state(bm, a, b) == before
    assert bm.allocate(b, 2, hit)  # exactly the one free block
    assert bm.num_free_blocks == 0
    bm.check_invariants([a, b])


def test_reviving_free_cached_blocks_counts_against_the_free_list():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(13)))  # 3 full cached blocks + 1 partial
    bm.free(a)
    b = req(list(range(12)) + [1, 2, 3, 4, 5])
    hit = bm.get_computed_blocks(b)
    assert len(hit) == 3
    assert not bm.can_allocate(b, 5, hit)  # 3 revived + 2 new > 4 free
    assert bm.can_allocate(b, 4, hit)
    assert bm.allocate(b, 4, hit) and bm.num_free_blocks == 0
    bm.check_invariants([b])


def test_computed_blocks_only_on_first_allocation():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    computed(bm, req(range(9)))
    b = req(range(9))
    hit = bm.get_computed_blocks(b)
    bm.allocate(b, 1, hit)
    with pytest.raises(ValueError):
        bm.allocate(b, 1, hit)


def test_preempted_request_rehits_its_own_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, req(range(10)))
    a.append_token(50)
    bm.free(a)
    a.num_computed_tokens = 0
    assert bm.get_computed_blocks(a) == [0, 1]  # 11 tokens: blocks 0, 1 full; block 2 never registered


def test_blocks_behind_a_sliding_window_are_released_once_and_never_freed_twice():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, window=6)
    r = req(list(range(10, 24)))  # 14 tokens
    assert bm.allocate(r, 14)
    r.num_computed_tokens = 14
    bm.cache_full_blocks(r, 14)
    bm.release_outside_window(r)  # the next query (position 14) sees keys 9..14: blocks 0 and 1 are behind
    assert r.num_released_blocks == 2 and bm.num_free_blocks == 8 - 4 + 2
    bm.release_outside_window(r)
    assert bm.num_free_blocks == 6
    bm.check_invariants([r])
    other = req(list(range(10, 19)))  # the released blocks keep their prefix: a later request hits them
    assert bm.get_computed_blocks(other) == r.block_ids[:2]
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.num_released_blocks == 0
    bm.check_invariants([])


def test_no_window_or_a_short_sequence_releases_nothing():
    for window, computed in ((None, 14), (16, 14)):
        bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, window=window)
        r = req(list(range(14)))
        assert bm.allocate(r, 14)
        r.num_computed_tokens = computed
        bm.release_outside_window(r)
        assert r.num_released_blocks == 0 and bm.num_free_blocks == 4
