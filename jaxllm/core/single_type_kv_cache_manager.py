"""The blocks of one KV cache group (models/kv_layout.py): full attention, a sliding window, or
Mamba layers' state slots.

A request's block list in a group is indexed by block position (token // block_size);
None marks a position the group does not hold: a sliding window's blocks that fell
out of the window, or that a prefix hit did not need. The runner's block table
writes 0 there, which no token reads unmasked and none writes.
"""
import math

from jaxllm.core.block_pool import BlockPool, KVCacheBlock
from jaxllm.core.kv_cache_utils import BlockHash
from jaxllm.models.kv_layout import KVCacheGroup
from jaxllm.utils import cdiv

Blocks = list[KVCacheBlock | None]


class FullAttentionManager:
    def __init__(self, pool: BlockPool, group: int, block_size: int):
        self.pool, self.group, self.block_size = pool, group, block_size
        self.req_to_blocks: dict[str, Blocks] = {}
        self._num_cached: dict[str, int] = {}  # a request's leading blocks already offered to the cache

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_length: int) -> Blocks:
        """The cached blocks of the longest prefix of at most `max_length` tokens."""
        hit = []
        for block_hash in hashes[:max_length // self.block_size]:
            block = self.pool.get_cached_block(self.group, block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention reads every block: none to give back."""

    def num_blocks_needed(self, request_id: str, num_tokens: int, computed: Blocks) -> int:
        """Free blocks an allocation for `num_tokens` tokens takes: new ones, and the free ones among `computed`."""
        held = len(self.req_to_blocks.get(request_id, ())) + len(computed)
        revived = sum(1 for b in computed if b is not None and b.ref_cnt == 0)
        return max(cdiv(num_tokens, self.block_size) - held, 0) + revived

    def num_blocks_to_reach(self, request_id: str, num_tokens: int, computed: Blocks) -> int | float:
        """Free blocks the request takes, at most, from now until it holds `num_tokens` tokens (after the
        prefix hit `computed` of a request being admitted)."""
        return self.num_blocks_needed(request_id, num_tokens, computed)

    def allocate(self, request_id: str, num_tokens: int, computed: Blocks) -> Blocks:
        """Take the prefix hit's blocks `computed`, then new blocks up to `num_tokens` tokens.
        Returns the entries this adds to the request's list."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.pool.touch(b for b in computed if b is not None)  # first: a new block could evict a free one
        start = len(blocks)
        blocks += computed
        need = cdiv(num_tokens, self.block_size) - len(blocks)
        if need > 0:
            blocks += self.pool.get_new_blocks(need)
        return blocks[start:]

    def cache_blocks(self, request_id: str, hashes: list[BlockHash], num_full_blocks: int) -> None:
        """Offer the request's first `num_full_blocks` blocks (full, of known tokens; `hashes`
        has theirs) to the prefix cache."""
        blocks = self.req_to_blocks[request_id]
        start = self._num_cached.get(request_id, 0)
        for i in range(start, num_full_blocks):
            if blocks[i] is not None:
                self.pool.cache_block(blocks[i], self.group, hashes[i])
        self._num_cached[request_id] = max(start, num_full_blocks)

    def free(self, request_id: str) -> None:
        # Tail blocks first into the free queue, so they are the first evicted.
        blocks = self.req_to_blocks.pop(request_id, [])
        self._num_cached.pop(request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b is not None])


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, pool: BlockPool, group: int, block_size: int, sliding_window: int):
        super().__init__(pool, group, block_size)
        self.sliding_window = sliding_window
        # A hit of length L needs the blocks of positions [L - window + 1, L).
        self._window_blocks = cdiv(sliding_window - 1, block_size)

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_length: int) -> Blocks:
        """The longest L <= max_length whose last window is cached; from the right, as vLLM.
        Positions before the window are None. A cached run from the first block counts
        even when shorter than the window: there is nothing before it."""
        n = max_length // self.block_size
        if self._window_blocks == 0:
            return [None] * n
        hit: Blocks = [None] * n
        run = 0
        for i in range(n - 1, -1, -1):
            block = self.pool.get_cached_block(self.group, hashes[i])
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run == self._window_blocks:
                return [None] * i + hit[i:i + run]
        return hit[:run]

    def num_blocks_to_reach(self, request_id: str, num_tokens: int, computed: Blocks) -> int:
        """As the full attention's, but a request holds at most the window's blocks at once, the one the
        window starts in, and one for the drafts a step in flight may reject."""
        held = sum(b is not None for b in self.req_to_blocks.get(request_id, ())) + sum(b is not None for b in computed)
        revived = sum(1 for b in computed if b is not None and b.ref_cnt == 0)
        most = min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window, self.block_size) + 2)
        return max(most - held, 0) + revived

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the window of the next token (at num_computed_tokens)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        freed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):  # the blocks before a None are gone too
            if blocks[i] is None:
                break
            freed.append(blocks[i])
            blocks[i] = None
        self.pool.free_blocks(freed)


class MambaManager(FullAttentionManager):
    """One block per request from its first allocation to its end, whatever its length: its state
    slot in every Mamba layer of the group (vLLM's MambaSpec). A state holds the whole prefix it
    was computed from, so no block is cached (the engine turns prefix caching off: config.py).
    slots: a hybrid model's pool of state slots, apart from the KV blocks (models/kv_layout.py);
    None: the slots are the pool's blocks."""

    def __init__(self, pool: BlockPool, group: int, block_size: int, slots: BlockPool | None = None):
        super().__init__(slots or pool, group, block_size)
        self.own_slots = slots is not None

    def find_longest_cache_hit(self, hashes: list[BlockHash], max_length: int) -> Blocks:
        return []

    def num_blocks_needed(self, request_id: str, num_tokens: int, computed: Blocks) -> int | float:
        """Of the KV blocks: none from a pool of its own (infinitely many when every slot is taken)."""
        if request_id in self.req_to_blocks:
            return 0
        if self.own_slots:
            return 0 if self.pool.num_free_blocks else math.inf
        return 1

    def allocate(self, request_id: str, num_tokens: int, computed: Blocks) -> Blocks:
        if request_id in self.req_to_blocks:
            return []
        self.req_to_blocks[request_id] = self.pool.get_new_blocks(1)
        return self.req_to_blocks[request_id]

    def cache_blocks(self, request_id: str, hashes: list[BlockHash], num_full_blocks: int) -> None:
        """A state slot is never cached."""


def make_manager(pool: BlockPool, g: int, block_size: int, group: KVCacheGroup,
                 slots: BlockPool | None = None) -> FullAttentionManager:
    if group.mamba:
        return MambaManager(pool, g, block_size, slots)
    if group.sliding_window is None:
        return FullAttentionManager(pool, g, block_size)
    return SlidingWindowManager(pool, g, block_size, group.sliding_window)
