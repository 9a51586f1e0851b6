"""Packing a SchedulerOutput into the static-shape inputs of one jitted step.

Shapes depend only on the token bucket T (a power of two up to
max_num_batched_tokens): per-request arrays are padded to R = min(T, max_num_seqs),
so each bucket is one executable. Every input of a step lives in one int32 buffer
(floats and 64-bit seeds as their bits), so a step makes one host-to-device copy;
`BatchLayout` says where each field sits. The host buffers are allocated once per
bucket and written in place.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.sample.sampler import SamplingMetadata

_FLOAT32_FIELDS = ("temperature", "top_p", "min_p")
_UINT32_FIELDS = ("seeds",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    input_ids: jax.Array       # [T] int32
    prev_rows: jax.Array       # [T] int32: row of the previous step's sampled ids that holds this token, or -1
    positions: jax.Array       # [T] int32
    logits_indices: jax.Array  # [R] int32: last scheduled token of each request
    attention: AttentionMetadata
    sampling: SamplingMetadata


class BatchLayout:
    """Offsets and shapes of a bucket's fields in its int32 buffer."""

    def __init__(self, num_tokens: int, num_reqs: int, max_blocks_per_seq: int):
        T, R = num_tokens, num_reqs
        shapes = {
            "input_ids": (T,), "prev_rows": (T,), "positions": (T,), "slot_mapping": (T,),
            "logits_indices": (R,), "query_start_loc": (R + 1,), "seq_lens": (R,), "num_seqs": (1,),
            "temperature": (R,), "top_k": (R,), "top_p": (R,), "min_p": (R,), "seeds": (R, 2),
            "sample_positions": (R,), "block_tables": (R, max_blocks_per_seq),
        }
        self.num_tokens, self.num_reqs = T, R
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            self.fields[name] = (offset, shape)
            offset += math.prod(shape)
        self.size = offset

    def host_views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """numpy views of `buffer` [size] int32, one per field, in the field's dtype."""
        views = {}
        for name, (offset, shape) in self.fields.items():
            view = buffer[offset:offset + math.prod(shape)].reshape(shape)
            if name in _FLOAT32_FIELDS:
                view = view.view(np.float32)
            elif name in _UINT32_FIELDS:
                view = view.view(np.uint32)
            views[name] = view
        return views

    def unpack(self, buffer: jax.Array) -> StepBatch:
        """Inside the jitted step: the StepBatch that `buffer` [size] int32 holds."""
        def field(name):
            offset, shape = self.fields[name]
            x = buffer[offset:offset + math.prod(shape)].reshape(shape)
            if name in _FLOAT32_FIELDS:
                return jax.lax.bitcast_convert_type(x, jnp.float32)
            if name in _UINT32_FIELDS:
                return jax.lax.bitcast_convert_type(x, jnp.uint32)
            return x

        return StepBatch(
            input_ids=field("input_ids"), prev_rows=field("prev_rows"), positions=field("positions"),
            logits_indices=field("logits_indices"),
            attention=AttentionMetadata(slot_mapping=field("slot_mapping"), query_start_loc=field("query_start_loc"),
                                        seq_lens=field("seq_lens"), block_tables=field("block_tables"),
                                        num_seqs=field("num_seqs")),
            sampling=SamplingMetadata(temperature=field("temperature"), top_k=field("top_k"), top_p=field("top_p"),
                                      min_p=field("min_p"), seeds=field("seeds"), positions=field("sample_positions")))


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

    def clear(self) -> None:
        self._rows.clear()
        self._lengths.clear()


def token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    buckets, b = [], smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


def request_bucket(token_bucket: int, max_num_seqs: int) -> int:
    return min(token_bucket, max_num_seqs)


def fill_padding(v: dict[str, np.ndarray]) -> None:
    """An all-padding batch (warm-up compiles with these): no request, no KV writes."""
    for view in v.values():
        view[...] = 0
    v["slot_mapping"][:] = -1
    v["prev_rows"][:] = -1
    v["top_p"][:] = 1.0


def pack(sched: SchedulerOutput, block_tables: BlockTables, prev_rows: dict[str, int],
         v: dict[str, np.ndarray], block_size: int) -> None:
    """Write the scheduled requests into a bucket's host views `v` (block_tables already
    updated for this step). A request's last token may be one the previous step is
    still sampling on the device: `prev_rows` maps such a request to its row there,
    and the step reads the token from the device instead of the host."""
    reqs = sched.requests
    n = len(reqs)
    counts = np.fromiter((s.num_new_tokens for s in reqs), np.int32, n)
    starts = np.fromiter((s.num_computed_tokens for s in reqs), np.int32, n)
    known = np.fromiter((s.request.num_tokens for s in reqs), np.int32, n)  # tokens whose ids the host has
    ends = starts + counts
    total = int(counts.sum())

    qsl = v["query_start_loc"]
    qsl[0] = 0
    np.cumsum(counts, out=qsl[1:n + 1])
    qsl[n + 1:] = total
    v["seq_lens"][:n] = ends
    v["seq_lens"][n:] = 0
    v["num_seqs"][0] = n
    if n:
        v["block_tables"][:n] = block_tables.rows(sched)
    last = qsl[1:n + 1] - 1
    v["logits_indices"][:n] = last

    # Token ids: from the host, except a last token still on the device.
    on_device = np.flatnonzero(ends > known)
    prev = v["prev_rows"]
    prev[:] = -1
    prev[last[on_device]] = [prev_rows[reqs[i].request.request_id] for i in on_device]
    host_tokens = [t for i in np.flatnonzero(np.minimum(ends, known) > starts)
                   for t in reqs[i].request.token_ids(int(starts[i]), int(min(ends[i], known[i])))]
    input_ids = v["input_ids"]
    if len(on_device):
        input_ids[:total][prev[:total] < 0] = host_tokens
    else:
        input_ids[:total] = host_tokens

    # [2, 3] tokens of requests starting at [5, 0] -> positions [5, 6, 0, 1, 2]
    req_of_token = np.repeat(np.arange(n), counts)
    pos = np.arange(total, dtype=np.int32) - qsl[req_of_token] + starts[req_of_token]
    v["positions"][:total] = pos
    slots = v["slot_mapping"]
    slots[:total] = v["block_tables"][req_of_token, pos // block_size] * block_size + pos % block_size
    slots[total:] = -1

    params = [s.request.sampling_params for s in reqs]
    v["temperature"][:n] = [p.temperature for p in params]
    v["top_k"][:n] = np.minimum([p.top_k for p in params], np.iinfo(np.int32).max)
    v["top_p"][:n] = [p.top_p for p in params]
    v["min_p"][:n] = [p.min_p for p in params]
    v["temperature"][n:], v["top_k"][n:], v["top_p"][n:], v["min_p"][n:] = 0.0, 0, 1.0, 0.0  # padding: greedy
    seeds = np.fromiter((s.request.seed for s in reqs), np.uint64, n)
    v["seeds"][:n, 0], v["seeds"][:n, 1] = seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)
    v["sample_positions"][:n] = ends
