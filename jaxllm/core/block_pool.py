"""BlockPool: the KV cache blocks, their reference counts, the free queue and the prefix cache.

A full block whose tokens are known can be cached: the pool indexes it by its
group and its block hash (kv_cache_utils.hash_block), and a request whose prompt
starts with the same tokens takes the block instead of recomputing it. A cached
block that its requests free stays cached, in the free queue, until the pool
hands it out again (evicting it): the free queue is in LRU order, and requests
free their tail blocks first, so a prefix's last blocks go before its first.
"""
import dataclasses

from jaxllm.core.kv_cache_utils import BlockHash


@dataclasses.dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    cache_key: tuple[int, BlockHash] | None = None  # (group, block hash) while the prefix cache holds it


class BlockPool:
    """Hands out blocks and takes them back. Free blocks wait in LRU order (a dict
    keeps insertion order and removes from the middle in O(1), to revive a cached one)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: dict[int, KVCacheBlock] = {b.block_id: b for b in self.blocks}
        self._cached: dict[tuple[int, BlockHash], KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """The `n` least recently freed blocks, each with one reference; a cached one leaves the cache."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        taken = []
        for _ in range(n):
            block = self._free.pop(next(iter(self._free)))
            if block.cache_key is not None:
                del self._cached[block.cache_key]
                block.cache_key = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def get_cached_block(self, group: int, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get((group, block_hash))

    def touch(self, blocks) -> None:
        """Take one more reference on each of `blocks` (a prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, group: int, block_hash: BlockHash) -> None:
        """Index a full block of known tokens. If the cache holds those tokens in another block
        already (two requests computed the same prefix side by side), this one stays uncached."""
        if not self.enable_caching or block.cache_key is not None:
            return
        key = (group, block_hash)
        if key not in self._cached:
            self._cached[key] = block
            block.cache_key = key

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block; blocks left unreferenced join the free queue's tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only when no request holds a block (False otherwise, as vLLM)."""
        if len(self._free) != len(self.blocks):
            return False
        for block in self._cached.values():
            block.cache_key = None
        self._cached.clear()
        return True
