from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def cached(bm, tokens, rid="r", salt=None):
    """A sequence of `tokens`, allocated and computed, its full blocks in the prefix cache."""
    s = Sequence(rid, list(tokens), SamplingParams(), cache_salt=salt)
    assert bm.allocate(s, len(s.token_ids))
    s.num_computed_tokens = len(s.token_ids)
    bm.cache_full_blocks(s)
    return s


def test_allocate_grows_table_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    assert bm.allocate(s, 12)  # still 3 blocks
    assert len(s.block_table) == 3
    assert bm.allocate(s, 13)
    assert len(s.block_table) == 4
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(range(12), "a"), seq(range(8), "b")
    assert bm.allocate(a, 12)
    assert not bm.allocate(b, 8)  # needs 2, only 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.usage == 0.75


def test_prefix_cache_hit_shares_blocks_and_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = cached(bm, list(range(10)), "a")  # 2 full blocks cached
    b = seq(list(range(8)) + [99, 98, 97], "b")
    hit = bm.match_prefix(b)
    assert hit == a.block_table[:2]
    assert bm.allocate(b, 11, hit)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[hit[0]].ref_count == 2
    bm.record_prefix_lookup(b.num_tokens, len(hit) * 4)
    assert (bm.prefix_stats.queries, bm.prefix_stats.hits) == (11, 8)


def test_prefix_cache_miss_on_different_prefix_and_partial_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = cached(bm, list(range(10)), "a")
    assert bm.match_prefix(seq([5] + list(range(1, 10)), "b")) == []  # first block differs
    assert bm.match_prefix(seq(list(range(4)) + [0, 0, 0, 0, 1], "c")) == a.block_table[:1]
    # the third block of `a` was partial: never cached
    assert len(bm.hash_to_block) == 2


def test_prefix_cache_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = cached(bm, list(range(8)), "a")
    same = seq(list(range(8)), "b")
    assert bm.match_prefix(same) == a.block_table[:1]  # the last block is recomputed


def test_uncomputed_or_draft_tokens_are_never_cached():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(8)), "a")
    bm.allocate(a, 12)
    a.num_draft_tokens = 4
    a.num_computed_tokens = 6  # second block not computed yet
    bm.cache_full_blocks(a)
    assert len(bm.hash_to_block) == 1
    a.num_computed_tokens = 12  # drafts computed, but only committed tokens count
    bm.cache_full_blocks(a)
    assert len(bm.hash_to_block) == 2


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = cached(bm, list(range(9)), "a")
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    # still a hit after free
    b = seq(list(range(8)) + [7], "b")
    hit = bm.match_prefix(b)
    assert len(hit) == 2
    assert bm.allocate(b, 9, hit) and bm.num_free_blocks == 1
    bm.free(b)
    # a new, unrelated sequence that needs the whole pool evicts the cached blocks
    c = seq([200] * 16, "c")
    assert bm.allocate(c, 16)
    assert bm.hash_to_block == {}
    assert bm.match_prefix(seq(list(range(8)) + [1], "d")) == []


def test_shared_block_survives_until_last_reference_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = cached(bm, list(range(5)), "a")
    b = seq(list(range(4)) + [9], "b")
    hit = bm.match_prefix(b)
    bm.allocate(b, 5, hit)
    shared = hit[0]
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_queue
    bm.free(b)
    assert bm.blocks[shared].ref_count == 0 and shared in bm.free_queue


def test_cache_salt_partitions_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = cached(bm, range(10), "a", "tenant-a")
    same = Sequence("b", list(range(10)), SamplingParams(), cache_salt="tenant-a")
    assert bm.match_prefix(same) == a.block_table[:2]
    for other in ("tenant-b", None):  # another tenant, or no salt: never a hit
        assert bm.match_prefix(Sequence("c", list(range(10)), SamplingParams(),
                                        cache_salt=other)) == []
    unsalted = cached(bm, range(10), "d", None)  # cached apart, under its own keys
    assert bm.match_prefix(seq(range(10), "e")) == unsalted.block_table[:2]
    assert set(unsalted.block_table[:2]).isdisjoint(a.block_table[:2])


def test_cache_salt_is_checked_even_when_hashes_collide(monkeypatch):
    import engine.block_manager as block_manager

    # every block hashes alike: only the stored tokens and salt can tell them apart
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: hash(tokens))
    bm = BlockManager(num_blocks=16, block_size=4)
    a = cached(bm, range(10), "a", "tenant-a")
    assert bm.match_prefix(Sequence("b", list(range(10)), SamplingParams(),
                                    cache_salt="tenant-b")) == []
    assert bm.match_prefix(Sequence("c", list(range(10)), SamplingParams(),
                                    cache_salt="tenant-a")) == a.block_table[:2]
