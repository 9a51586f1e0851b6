"""Block hashes for the prefix cache.

A full block's hash is SHA-256 over its parent block's hash, its token ids (int32
bytes) and any extra keys (a LoRA request's adapter: Request.block_hash_keys), so equal
hashes mean equal prefixes of the same weights, not only equal blocks. SHA-256 from
the standard library: collisions are out of reach (a collision would silently serve
another prompt's KV), its digest is stable across processes
and runs (Python's hash() of a tuple is neither), and at about 1 us for a block of
16 tokens it costs less than the Python around it.
"""
import array
import hashlib

BlockHash = bytes  # a 32-byte SHA-256 digest


def hash_block(parent: BlockHash | None, token_ids, extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256(parent or b"")
    h.update(array.array("i", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def update_block_hashes(request, block_size: int, num_tokens: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to every full block of its first `num_tokens` tokens
    (which must be known), hashing each block once. Returns the list."""
    hashes = request.block_hashes
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, request.token_ids(i * block_size, (i + 1) * block_size),
                                 request.block_hash_keys))
    return hashes
