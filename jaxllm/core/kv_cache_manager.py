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

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed > self.pool.num_free_blocks:
            return False
        if needed > 0:
            blocks.extend(self.pool.get_new_blocks(needed))
        return True

    def free(self, request: Request) -> None:
        # Tail blocks first into the free queue, so they are the first to be reused.
        self.pool.free_blocks(reversed(self.req_to_blocks.pop(request.request_id, [])))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
