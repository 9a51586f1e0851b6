"""KVCacheCoordinator: one request's blocks over every KV cache group, and what a prefix hit may reuse.

Three strategies, as vLLM's:
  no prefix cache  every group allocates; nothing is looked up
  unitary          one group (today's models with one attention type): its longest hit
  hybrid           several groups (Gemma 3: full attention and a sliding window): a hit
                   must hold in every group, so the length shrinks until each agrees
"""
from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_utils import BlockHash
from jaxllm.core.single_type_kv_cache_manager import Blocks, make_manager
from jaxllm.models.kv_layout import KVCacheLayout


class NoPrefixCacheCoordinator:
    def __init__(self, layout: KVCacheLayout, pool: BlockPool, block_size: int, num_state_slots: int = 0):
        """num_state_slots: a hybrid layout's state slots, a pool of their own (models/kv_layout.py)."""
        self.block_size = block_size
        self.state_slots = BlockPool(num_state_slots, enable_caching=False) if layout.hybrid else None
        self.managers = [make_manager(pool, g, block_size, group, self.state_slots)
                         for g, group in enumerate(layout.groups)]
        self.no_hit: list[Blocks] = [[] for _ in self.managers]

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_length: int) -> tuple[list[Blocks], int]:
        """(per group, the hit's blocks; the hit's length in tokens)."""
        return self.no_hit, 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_blocks_needed(self, request_id: str, num_tokens: int, computed: list[Blocks]) -> int | float:
        """Free blocks of the pool an allocation takes (infinitely many when a state slot it needs is not free)."""
        return sum(m.num_blocks_needed(request_id, num_tokens, c) for m, c in zip(self.managers, computed))

    def num_blocks_to_reach(self, request_id: str, num_tokens: int, computed: list[Blocks]) -> int | float:
        """Free blocks of the pool the request takes, at most, until it holds num_tokens tokens."""
        return sum(m.num_blocks_to_reach(request_id, num_tokens, c) for m, c in zip(self.managers, computed))

    def allocate(self, request_id: str, num_tokens: int, computed: list[Blocks]) -> list[Blocks]:
        return [m.allocate(request_id, num_tokens, c) for m, c in zip(self.managers, computed)]

    def cache_blocks(self, request_id: str, hashes: list[BlockHash], num_full_blocks: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request_id, hashes, num_full_blocks)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)


class UnitaryCoordinator(NoPrefixCacheCoordinator):
    def find_longest_cache_hit(self, hashes, max_length):
        hit = self.managers[0].find_longest_cache_hit(hashes, max_length)
        return [hit], len(hit) * self.block_size


class HybridCoordinator(NoPrefixCacheCoordinator):
    def find_longest_cache_hit(self, hashes, max_length):
        # Each group's hit is at most the length asked; shrink it until every group returns it.
        length = max_length - max_length % self.block_size
        while True:
            hits = [m.find_longest_cache_hit(hashes, length) for m in self.managers]
            shortest = min(len(hit) for hit in hits) * self.block_size
            if shortest == length:
                return hits, length
            length = shortest


def make_coordinator(layout: KVCacheLayout, pool: BlockPool, block_size: int,
                     num_state_slots: int = 0) -> NoPrefixCacheCoordinator:
    if not pool.enable_caching:
        return NoPrefixCacheCoordinator(layout, pool, block_size, num_state_slots)
    if len(layout.groups) == 1:
        return UnitaryCoordinator(layout, pool, block_size, num_state_slots)
    return HybridCoordinator(layout, pool, block_size, num_state_slots)
