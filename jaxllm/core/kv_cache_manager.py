"""KVCacheManager: the scheduler's view of the KV cache: which blocks each request
holds in each group, and the prefix a waiting request finds already cached."""
from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_coordinator import make_coordinator
from jaxllm.core.kv_cache_utils import update_block_hashes
from jaxllm.core.single_type_kv_cache_manager import Blocks
from jaxllm.models.kv_layout import KVCacheGroup, KVCacheLayout
from jaxllm.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, layout: KVCacheLayout | None = None,
                 enable_caching: bool = True, use_eagle: bool = False, num_state_slots: int = 0):
        """use_eagle: an EAGLE head's KV shares the blocks; a prefix hit then ends a block earlier (vLLM's).
        num_state_slots: a hybrid layout's Mamba state slots, apart from the blocks (models/kv_layout.py)."""
        self.block_size = block_size
        self.use_eagle = use_eagle
        self.layout = layout or KVCacheLayout((KVCacheGroup(None, (0,)),), 1)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.coordinator = make_coordinator(self.layout, self.pool, block_size, num_state_slots)
        # The decode fast path: most steps add no block and fill none. Per request, the tokens its
        # blocks hold and the full blocks offered to the cache; a sliding window frees blocks as it
        # moves, so models with one take the full path.
        self._num_slots: dict[str, int] = {}
        self._num_full_blocks: dict[str, int] = {}
        self._fast_path = all(g.sliding_window is None for g in self.layout.groups)
        self._nothing_new: list[list[int]] = [[] for _ in self.layout.groups]

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def state_slots(self) -> BlockPool | None:
        """A hybrid layout's pool of Mamba state slots; None for any other."""
        return self.coordinator.state_slots

    @property
    def usage(self) -> float:
        """The share of blocks requests hold (cached blocks no request holds count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[Blocks], int]:
        """The longest cached prefix of a request about to be admitted: (per group, its
        blocks; its length in tokens). Never the whole request: its last token is computed,
        so the step has its logits. Requests that need every prompt position computed (prompt
        logprobs, a pooler of every token) read no prefix (as vLLM)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.coordinator.no_hit, 0
        hashes = update_block_hashes(request, self.block_size, request.num_tokens)
        hit = self.coordinator.find_longest_cache_hit(hashes, request.num_tokens - 1)
        if self.use_eagle and hit[1]:
            # An EAGLE head's KV at a position was made with the token after it, which the hit's last
            # block's hash does not cover: that block is computed again, the head's KV with this request's.
            hit = self.coordinator.find_longest_cache_hit(hashes, hit[1] - 1)
        return hit

    def allocate_slots(self, request: Request, num_new_tokens: int, num_computed_tokens: int = 0,
                       computed_blocks: list[Blocks] | None = None,
                       num_lookahead_tokens: int = 0, num_unverified_tokens: int = 0) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens of `request`, after the prefix hit
        (`computed_blocks`, `num_computed_tokens` tokens) of a request being admitted, and for
        `num_lookahead_tokens` after them (a draft model's KV). The last `num_unverified_tokens`
        of its computed ones are drafts a step in flight may reject: a sliding window keeps the
        blocks the positions before them read. Returns, per group, the block ids this adds to its
        block table (0 where the group holds no block), or None if the pool is short (and then
        takes nothing)."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_computed_tokens + num_new_tokens
        num_tokens = num_computed + num_lookahead_tokens
        # Blocks whose tokens are all known can be cached (an in-flight token is not known yet).
        num_full_blocks = min(num_computed, request.num_tokens) // self.block_size if self.enable_caching else 0
        if (self._fast_path and computed_blocks is None and num_tokens <= self._num_slots.get(request_id, 0)
                and num_full_blocks <= self._num_full_blocks.get(request_id, 0)):
            return self._nothing_new
        self.coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens - num_unverified_tokens)
        computed = computed_blocks or self.coordinator.no_hit
        if self.coordinator.num_blocks_needed(request_id, num_tokens, computed) > self.pool.num_free_blocks:
            return None
        added = self.coordinator.allocate(request_id, num_tokens, computed)
        if self.enable_caching:
            hashes = update_block_hashes(request, self.block_size, num_full_blocks * self.block_size)
            self.coordinator.cache_blocks(request_id, hashes, num_full_blocks)
        self._num_slots[request_id] = -(-num_tokens // self.block_size) * self.block_size
        self._num_full_blocks[request_id] = max(num_full_blocks, self._num_full_blocks.get(request_id, 0))
        return [[0 if b is None else b.block_id for b in blocks] for blocks in added]

    def num_blocks_to_reach(self, request: Request, num_tokens: int, computed_blocks: list[Blocks] | None = None
                            ) -> int | float:
        """Free blocks `request` takes, at most, from now until it holds `num_tokens` tokens (after the
        prefix hit `computed_blocks` of a request being admitted): what the guaranteed-no-evict
        admission (core/scheduler.py) keeps for it."""
        return self.coordinator.num_blocks_to_reach(request.request_id, num_tokens,
                                                    computed_blocks or self.coordinator.no_hit)

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)
        self._num_slots.pop(request.request_id, None)
        self._num_full_blocks.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
