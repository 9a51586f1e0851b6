"""BlockPool: the KV cache blocks, their reference counts and the free queue."""
import dataclasses


@dataclasses.dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Hands out blocks and takes them back. Free blocks wait in LRU order (a dict
    keeps insertion order and removes from the middle in O(1), which prefix
    caching will need to revive a freed block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: dict[int, KVCacheBlock] = {b.block_id: b for b in self.blocks}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        taken = []
        for _ in range(n):
            block = self._free.pop(next(iter(self._free)))
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks left unreferenced join the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
