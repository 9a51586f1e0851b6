"""Packing a SchedulerOutput into the static-shape batch of one jitted step.

Shapes depend only on the token bucket T (a power of two up to
max_num_batched_tokens): per-request arrays are padded to R = min(T, max_num_seqs),
so each bucket is one executable. All arrays are built with numpy in one pass.
"""
import dataclasses
import itertools

import jax
import numpy as np

from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.sample.sampler import SamplingMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    input_ids: np.ndarray       # [T] int32
    positions: np.ndarray       # [T] int32
    logits_indices: np.ndarray  # [R] int32: last scheduled token of each request
    attention: AttentionMetadata
    sampling: SamplingMetadata


class BlockTables:
    """The runner's host copy of each running request's block table. A step writes only
    the blocks the scheduler added, so packing costs O(new blocks), not O(context)."""

    def __init__(self, max_blocks_per_seq: int):
        self.max_blocks_per_seq = max_blocks_per_seq
        self._rows: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}

    def update(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_req_ids:
            self._rows.pop(request_id, None)
            self._lengths.pop(request_id, None)
        for s in sched.requests:
            request_id = s.request.request_id
            if s.num_computed_tokens == 0:  # new, or recomputing after preemption: fresh blocks
                self._rows[request_id] = np.zeros(self.max_blocks_per_seq, np.int32)
                self._lengths[request_id] = 0
            n = self._lengths[request_id]
            self._rows[request_id][n:n + len(s.new_block_ids)] = s.new_block_ids
            self._lengths[request_id] = n + len(s.new_block_ids)

    def rows(self, sched: SchedulerOutput) -> list[np.ndarray]:
        return [self._rows[s.request.request_id] for s in sched.requests]


def token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    buckets, b = [], smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


def request_bucket(token_bucket: int, max_num_seqs: int) -> int:
    return min(token_bucket, max_num_seqs)


def empty_batch(num_tokens: int, num_reqs: int, max_blocks_per_seq: int) -> StepBatch:
    """An all-padding batch of the given bucket (warm-up compiles with these)."""
    i32 = lambda *shape: np.zeros(shape, np.int32)
    return StepBatch(
        input_ids=i32(num_tokens), positions=i32(num_tokens), logits_indices=i32(num_reqs),
        attention=AttentionMetadata(slot_mapping=np.full(num_tokens, -1, np.int32),
                                    query_start_loc=i32(num_reqs + 1), seq_lens=i32(num_reqs),
                                    block_tables=i32(num_reqs, max_blocks_per_seq), num_seqs=i32(1)),
        sampling=SamplingMetadata(temperature=np.zeros(num_reqs, np.float32), top_k=i32(num_reqs),
                                  top_p=np.ones(num_reqs, np.float32), min_p=np.zeros(num_reqs, np.float32),
                                  seeds=np.zeros((num_reqs, 2), np.uint32), positions=i32(num_reqs)))


def pack(sched: SchedulerOutput, block_tables: BlockTables, num_tokens: int, num_reqs: int,
         block_size: int) -> StepBatch:
    """Fill an empty batch of bucket (num_tokens, num_reqs) with the scheduled requests
    (block_tables already updated for this step)."""
    batch = empty_batch(num_tokens, num_reqs, block_tables.max_blocks_per_seq)
    reqs = sched.requests
    n = len(reqs)
    counts = np.fromiter((s.num_new_tokens for s in reqs), np.int32, n)
    starts = np.fromiter((s.num_computed_tokens for s in reqs), np.int32, n)
    total = int(counts.sum())
    attn, smp = batch.attention, batch.sampling

    qsl = attn.query_start_loc
    np.cumsum(counts, out=qsl[1:n + 1])
    qsl[n + 1:] = total
    attn.seq_lens[:n] = starts + counts
    attn.num_seqs[0] = n
    if n:
        attn.block_tables[:n] = block_tables.rows(sched)
    batch.input_ids[:total] = np.fromiter(itertools.chain.from_iterable(
        s.request.token_ids(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens) for s in reqs),
        np.int32, total)

    req_of_token = np.repeat(np.arange(n), counts)
    pos = np.arange(total, dtype=np.int32) - qsl[req_of_token] + starts[req_of_token]
    batch.positions[:total] = pos
    attn.slot_mapping[:total] = attn.block_tables[req_of_token, pos // block_size] * block_size + pos % block_size
    batch.logits_indices[:n] = qsl[1:n + 1] - 1

    params = [s.request.sampling_params for s in reqs]
    smp.temperature[:n] = [p.temperature for p in params]
    smp.top_k[:n] = np.minimum([p.top_k for p in params], np.iinfo(np.int32).max)
    smp.top_p[:n] = [p.top_p for p in params]
    smp.min_p[:n] = [p.min_p for p in params]
    seeds = np.array([s.request.seed for s in reqs], np.uint64)
    smp.seeds[:n, 0], smp.seeds[:n, 1] = seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)
    smp.positions[:n] = attn.seq_lens[:n]
    return batch
