"""KVCacheManager: which blocks each request holds."""
from jaxllm.core.block_pool import BlockPool, KVCacheBlock
from jaxllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`: the ids of the blocks
        this adds (often none), or None if the pool is short."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            return None
        new = self.pool.get_new_blocks(needed)
        blocks.extend(new)
        return [b.block_id for b in new]

    def free(self, request: Request) -> None:
        # Tail blocks first into the free queue, so they are the first to be reused.
        self.pool.free_blocks(reversed(self.req_to_blocks.pop(request.request_id, [])))
