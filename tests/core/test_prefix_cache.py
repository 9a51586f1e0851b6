"""The prefix cache and the KV cache groups, without a model: hashing, hits, reference
counts, LRU eviction, sliding windows and the hybrid rule."""
from jaxllm.config import SchedulerConfig
from jaxllm.contracts.step import ModelRunnerOutput
from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.kv_cache_utils import hash_block
from jaxllm.core.scheduler import Scheduler
from jaxllm.models.kv_layout import KVCacheGroup, KVCacheLayout, kv_cache_layout
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

BLOCK = 4


def request(i, tokens, max_tokens=4, **params):
    return Request(str(i), list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                   eos_token_ids=(), seed=i)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit `req` as the scheduler does (its whole prompt at once); returns the hit's length."""
    blocks, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, num_cached, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return num_cached


def held(kv: KVCacheManager, req: Request, group: int = 0) -> list:
    return kv.coordinator.managers[group].req_to_blocks[req.request_id]


def test_block_hashes_chain_on_the_parent():
    a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [5, 6, 7, 8])
    assert hash_block(a, [5, 6, 7, 8]) != b  # the same tokens after another prefix
    assert hash_block(a, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_an_equal_prefix_hits_and_a_changed_token_misses_from_its_block_on():
    kv = KVCacheManager(32, BLOCK)
    tokens = list(range(1, 18))  # 4 full blocks and one token
    first = request(0, tokens)
    assert admit(kv, first) == 0
    assert admit(kv, request(1, tokens)) == 16  # all 4 full blocks; the 17th token is computed
    changed = tokens.copy()
    changed[9] = 99  # in block 2
    assert admit(kv, request(2, changed)) == 8
    # Hit blocks are shared, not copied.
    assert held(kv, request(2, changed))[:2] == held(kv, first)[:2]
    assert held(kv, first)[0].ref_cnt == 3


def test_a_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(32, BLOCK)
    admit(kv, request(0, range(1, 9)))  # exactly two blocks
    assert admit(kv, request(1, range(1, 9))) == 4  # its last token must be computed: one block


def test_with_an_eagle_head_a_hit_ends_a_block_earlier():
    """The head's KV at a block's last position was made with the token after the block: that
    block is computed again, as vLLM does."""
    kv = KVCacheManager(32, BLOCK, use_eagle=True)
    tokens = list(range(1, 18))  # 4 full blocks and one token
    admit(kv, request(0, tokens))
    assert admit(kv, request(1, tokens)) == 12
    assert admit(kv, request(2, tokens[:6])) == 0  # a one-block hit is no hit


def test_the_partial_last_block_is_never_cached():
    kv = KVCacheManager(32, BLOCK)
    admit(kv, request(0, range(1, 7)))  # a full block and 2 tokens
    assert kv.pool.num_cached_blocks == 1
    assert admit(kv, request(1, range(1, 11))) == 4


def test_an_in_flight_token_is_cached_only_once_known():
    kv = KVCacheManager(32, BLOCK)
    req = request(0, range(1, 4))  # 3 tokens; the 4th is sampled by a step still on the device
    admit(kv, req)
    assert kv.allocate_slots(req, 1) == [[]]  # its KV slot: block 0 fills, but token 4's id is unknown
    assert kv.pool.num_cached_blocks == 0
    req.append_token(50)
    req.num_computed_tokens = 4
    kv.allocate_slots(req, 1)
    assert kv.pool.num_cached_blocks == 1


def test_freed_blocks_stay_hittable_until_evicted_in_lru_order():
    kv = KVCacheManager(6, BLOCK)
    a = request(0, range(1, 10))   # blocks a0 a1 + partial
    admit(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 6 and kv.pool.num_cached_blocks == 2
    # The free queue: the 3 blocks never used, then a's in reverse (its partial tail, a1, a0).
    b = request(1, range(100, 117))  # takes 5 blocks: a1 is evicted, a0 survives
    admit(kv, b)
    assert kv.pool.num_cached_blocks == 1 + 4  # a0, and b's 4 full blocks
    assert kv.get_computed_blocks(request(2, range(1, 10)))[1] == 4  # a0 hits; a1 is gone


def test_reference_counts_keep_a_shared_block_until_its_last_request_frees_it():
    kv = KVCacheManager(16, BLOCK)
    a, b = request(0, range(1, 10)), request(1, range(1, 10))
    admit(kv, a), admit(kv, b)
    shared = held(kv, a)[0]
    kv.free(a)
    assert shared.ref_cnt == 1 and kv.pool.num_free_blocks == 16 - 1 - 1 - 1  # b: shared, a1, its own tail
    kv.free(b)
    assert shared.ref_cnt == 0 and kv.pool.num_free_blocks == 16


def test_reset_prefix_cache_waits_for_every_block_to_be_free():
    kv = KVCacheManager(16, BLOCK)
    a = request(0, range(1, 10))
    admit(kv, a)
    assert not kv.reset_prefix_cache() and kv.pool.num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache() and kv.pool.num_cached_blocks == 0
    assert admit(kv, request(1, range(1, 10))) == 0


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    kv = KVCacheManager(16, BLOCK)
    admit(kv, request(0, range(1, 10)))
    assert admit(kv, request(1, range(1, 10), prompt_logprobs=1)) == 0


def test_a_short_pool_takes_nothing_and_revives_no_block():
    kv = KVCacheManager(4, BLOCK)
    a = request(0, range(1, 9))
    admit(kv, a)
    kv.free(a)
    b = request(1, list(range(1, 9)) + list(range(50, 70)))  # hits a0 a1, needs 5 more blocks: short
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert kv.allocate_slots(b, b.num_tokens - 8, 8, blocks) is None
    assert kv.pool.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_block_pool_counts_no_block_twice_when_caching_equal_blocks():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, 0, b"h")
    pool.cache_block(second, 0, b"h")  # the same tokens computed side by side: one stays uncached
    assert pool.num_cached_blocks == 1 and pool.get_cached_block(0, b"h") is first


# ---- KV cache groups ----

def test_layout_groups_layers_of_each_type_in_equal_sizes():
    windows = [8, 8, 8, 8, 8, None] * 3  # Gemma 3's pattern
    layout = kv_cache_layout(windows)
    assert layout.num_tensors == 3
    assert [g.sliding_window for g in layout.groups] == [None] + [8] * 5
    assert layout.groups[0].layers == (5, 11, 17) and layout.groups[1].layers == (0, 1, 2)
    assert layout.layer_slot(11) == (0, 1) and layout.layer_slot(4) == (2, 1)
    assert kv_cache_layout([None] * 4) == KVCacheLayout((KVCacheGroup(None, (0, 1, 2, 3)),), 4)


HYBRID = KVCacheLayout((KVCacheGroup(None, (0,)), KVCacheGroup(8, (1,))), 1)  # window 8: 2 blocks of 4


def test_a_sliding_window_group_holds_only_its_window_on_a_long_request():
    kv = KVCacheManager(64, BLOCK, HYBRID)
    req = request(0, range(1, 6), max_tokens=60)
    admit(kv, req)
    for token in range(60):
        req.append_token(token + 3)
        kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        sliding = [b for b in held(kv, req, 1) if b is not None]
        assert len(sliding) <= 8 // BLOCK + 1
    assert len(held(kv, req, 0)) == len(held(kv, req, 1)) == -(-req.num_tokens // BLOCK)
    kv.free(req)
    assert kv.pool.num_free_blocks == 64


def test_a_hybrid_hit_must_hold_in_every_group():
    kv = KVCacheManager(64, BLOCK, HYBRID)
    tokens = list(range(1, 30))
    a = request(0, tokens)
    admit(kv, a)
    assert admit(kv, request(1, tokens)) == 28  # every block of both groups still cached
    kv.free(a)
    kv2 = KVCacheManager(64, BLOCK, HYBRID)
    a = request(0, tokens)
    admit(kv2, a)
    # Evict the sliding group's blocks 4-6 (positions 16-27): a hit of 28 loses its window;
    # the longest length whose window is still cached is 16 (blocks 2-3).
    for i in (4, 5, 6):
        block = held(kv2, a, 1)[i]
        kv2.pool._cached.pop(block.cache_key)
        block.cache_key = None
    blocks, num_cached = kv2.get_computed_blocks(request(1, tokens))
    assert num_cached == 16
    assert len(blocks[0]) == 4 and blocks[1][:2] == [None, None] and None not in blocks[1][2:]


def test_scheduler_admits_after_the_cached_prefix_and_counts_it():
    kv = KVCacheManager(64, BLOCK)
    s = Scheduler(SchedulerConfig(8, 64, 64, async_scheduling=False), kv)
    s.add_request(request(0, range(1, 14)))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([[7]]))
    s.make_stats()
    s.add_request(request(1, range(1, 14)))
    out = s.schedule()
    new = next(r for r in out.scheduled if r.req_id == "1")
    assert new.num_computed_tokens == 12 and new.num_new_tokens == 1
    assert len(new.new_block_ids[0]) == 4  # the whole table of an admitted request: 3 hit blocks and 1 new
    outputs = s.update_from_output(out, ModelRunnerOutput([[7], [7]]))
    assert next(o for o in outputs if o.request_id == "1").num_cached_tokens == 12
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13, 12)
    assert s.make_stats().prefix_cache_hits == 0  # increments since the last stats


def test_requests_on_different_lora_adapters_never_share_cached_blocks():
    from jaxllm.core.kv_cache_utils import update_block_hashes
    from jaxllm.lora.request import LoRARequest
    from jaxllm.request import Request
    from jaxllm.sampling_params import SamplingParams

    def hashes(i, lora):
        request = Request(str(i), list(range(8)), SamplingParams(), eos_token_ids=(), seed=0, lora_request=lora)
        return update_block_hashes(request, 4, 8)

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    assert hashes(0, a) == hashes(1, LoRARequest("a", 1, "/a"))
    assert len({tuple(hashes(0, None)), tuple(hashes(1, a)), tuple(hashes(2, b))}) == 3
    assert not set(hashes(0, None)) & set(hashes(1, a))
