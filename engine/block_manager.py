"""KV block pool: block ids, ref counts, a free list and a prefix cache. Never touches a tensor.

Prefix cache: each *full, committed, computed* block is keyed by a chained hash
`hash((parent_hash, block_tokens))`, so equal keys mean equal whole prefixes. A hit is verified
against the block's stored tokens. Blocks whose ref count drops to zero stay cached on the free
list (least recently freed evicted first) until the pool needs them.

Tenant isolation: a sequence's `cache_salt` is the parent of its first block's hash, and every
cached block records the salt it was computed under; a hit needs an equal salt as well as equal
tokens, so sequences with different salts never share a block, whatever the hashes do.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # set with `hash`, to verify cache hits
    salt: str | None = None  # the cache salt the cached block belongs to


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache


def chain_hash(parent_hash: int | str | None, token_ids: tuple[int, ...]) -> int:
    """The key of a full block; the first block's parent is the sequence's cache salt."""
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Every block with ref_count 0, in eviction order (front first). Cached ones keep a hash.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_stats = PrefixCacheStats()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_hashes` over the full blocks of its first `num_tokens` committed tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), min(num_tokens, seq.num_tokens) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids for the longest cached prefix of `seq` (ref counts unchanged).

        At least one token is always left to compute, so the step produces logits.
        """
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(seq, seq.num_tokens)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        bs, matched = self.block_size, []
        for i, h in enumerate(seq.block_hashes[:max_blocks]):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if (block.salt != seq.cache_salt
                    or block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs])):
                break  # hash collision (or another tenant's block): a miss
            matched.append(block_id)
        return matched

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_query_tokens
            self.prefix_stats.hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` that are committed and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_done = min(seq.num_computed_tokens, seq.num_tokens)
        self._extend_hashes(seq, num_done)
        bs = self.block_size
        for i in range(num_done // bs):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.hash_to_block:
                continue  # an equal block is cached already; this one stays private
            block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block.salt = seq.cache_salt
            self.hash_to_block[h] = block.block_id

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow `seq.block_table` to hold `num_tokens` tokens, first adopting `cached_blocks`.

        All or nothing: returns False (changing nothing) if the pool is short.
        """
        num_new = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_blocks)
        # Adopting a cached block that sits on the free list takes it off the list too.
        num_cached_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(num_new, 0) > self.num_free_blocks - num_cached_free:
            return False
        for block_id in cached_blocks:
            self._take(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_new):
            block_id = next(iter(self.free_queue))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release all blocks of `seq`, tail first so the tail is evicted before shared prefixes."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []

    def consistent(self, sequences: list[Sequence]) -> bool:
        """Every block's ref count equals the block tables of `sequences` (all live ones) that
        hold it, and the free list is exactly the blocks nobody holds."""
        held = [0] * self.num_blocks
        for seq in sequences:
            for block_id in seq.block_table:
                if not 0 <= block_id < self.num_blocks:
                    return False
                held[block_id] += 1
        return (all(b.ref_count == n for b, n in zip(self.blocks, held))
                and set(self.free_queue) == {i for i, n in enumerate(held) if n == 0})

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.salt = None, None, None
