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

from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.sample.sampler import SampleMode, SamplingMetadata, sample_mode



_ALIGN = 64  # int32 words: 256 bytes


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
            "sampling": (R, 6),  # Request.sampling_row: temperature, top_k, top_p, min_p, seed high, seed low
            "sample_positions": (R,), "block_tables": (R, max_blocks_per_seq),
        }
        self.num_tokens, self.num_reqs = T, R
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            self.fields[name] = (offset, shape)
            # Kernels (Mosaic GPU) take their operands 256-byte aligned: XLA passes slices in place.
            offset += cdiv(math.prod(shape), _ALIGN) * _ALIGN
        self.size = offset

    def host_views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """numpy views of `buffer` [size] int32, one per field."""
        return {name: buffer[offset:offset + math.prod(shape)].reshape(shape)
                for name, (offset, shape) in self.fields.items()}

    def unpack(self, buffer: jax.Array) -> StepBatch:
        """Inside the jitted step: the StepBatch that `buffer` [size] int32 holds."""
        def field(name):
            offset, shape = self.fields[name]
            return buffer[offset:offset + math.prod(shape)].reshape(shape)

        sampling = field("sampling")
        as_f32 = lambda column: jax.lax.bitcast_convert_type(sampling[:, column], jnp.float32)
        return StepBatch(
            input_ids=field("input_ids"), prev_rows=field("prev_rows"), positions=field("positions"),
            logits_indices=field("logits_indices"),
            attention=AttentionMetadata(slot_mapping=field("slot_mapping"), query_start_loc=field("query_start_loc"),
                                        seq_lens=field("seq_lens"), block_tables=field("block_tables"),
                                        num_seqs=field("num_seqs")),
            sampling=SamplingMetadata(temperature=as_f32(0), top_k=sampling[:, 1], top_p=as_f32(2), min_p=as_f32(3),
                                      seeds=jax.lax.bitcast_convert_type(sampling[:, 4:6], jnp.uint32),
                                      positions=field("sample_positions")))


class RequestRows:
    """The runner's persistent host state, one row per request that holds KV blocks: its
    block table, its sampling inputs (Request.sampling_row), SampleMode and whether it
    wants logprobs, and its row in the last step's sampled ids. A step gathers its requests' rows in one copy each and
    writes only the blocks the scheduler added: packing costs O(new blocks), not O(context)."""

    def __init__(self, max_blocks_per_seq: int, num_rows: int):
        self.block_table = np.zeros((num_rows, max_blocks_per_seq), np.int32)
        self.sampling = np.zeros((num_rows, 6), np.int32)
        self.sample_mode = np.zeros(num_rows, np.int8)
        self.wants_logprobs = np.zeros(num_rows, bool)
        self.prev_sampled_row = np.full(num_rows, -1, np.int32)
        self._num_blocks = [0] * num_rows
        self._rows: dict[str, int] = {}  # request id -> its row
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def update(self, sched: SchedulerOutput) -> np.ndarray:
        """Apply the step's new requests and blocks; returns each scheduled request's row."""
        for request_id in sched.finished_req_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)
        rows = []
        for s in sched.requests:
            row = self._rows.get(s.request.request_id)
            if row is None:
                row = self._rows[s.request.request_id] = self._new_row()
                self.sampling[row] = s.request.sampling_row
                self.sample_mode[row] = sample_mode(s.request.sampling_params)
                self.wants_logprobs[row] = s.request.sampling_params.logprobs is not None
            if s.num_computed_tokens == 0:  # new, or recomputing after preemption: fresh blocks
                self._num_blocks[row] = 0
            if s.new_block_ids:
                n = self._num_blocks[row]
                self.block_table[row, n:n + len(s.new_block_ids)] = s.new_block_ids
                self._num_blocks[row] = n + len(s.new_block_ids)
            rows.append(row)
        return np.array(rows, np.int32)

    def _new_row(self) -> int:
        if not self._free_rows:  # preempted requests keep their rows: grow
            n = len(self.block_table)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.sampling = np.concatenate([self.sampling, np.zeros_like(self.sampling)])
            self.sample_mode = np.concatenate([self.sample_mode, np.zeros_like(self.sample_mode)])
            self.wants_logprobs = np.concatenate([self.wants_logprobs, np.zeros_like(self.wants_logprobs)])
            self.prev_sampled_row = np.concatenate([self.prev_sampled_row, np.full(n, -1, np.int32)])
            self._num_blocks += [0] * n
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def batch_sample_mode(self, rows: np.ndarray) -> SampleMode:
        return SampleMode(int(self.sample_mode[rows].max()))

    def clear(self) -> None:
        self._rows.clear()
        self._free_rows = list(range(len(self.block_table) - 1, -1, -1))


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


def pack(sched: SchedulerOutput, rows: np.ndarray, state: RequestRows, v: dict[str, np.ndarray],
         block_size: int) -> None:
    """Write the scheduled requests (at `rows` of `state`) into a bucket's host views `v`.
    A request's last token may be one the previous step is still sampling on the
    device: the step then reads it from there (`prev_rows`) instead of the host."""
    reqs = sched.requests
    n, total = len(reqs), sched.num_scheduled_tokens
    # One pass over the requests: their numbers, and the token ids the host has for the step.
    numbers, host_tokens = [], []
    for s in reqs:
        start, end, known = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens, s.request.num_tokens
        numbers.append((start, end, known, s.samples))
        if start < known:  # `known`: tokens whose ids the host has
            host_tokens += s.request.token_ids(start, min(end, known))
    starts, ends, known, samples = np.array(numbers, np.int32).T
    decode_only = total == n  # one token per request: the positions are the starts

    qsl = v["query_start_loc"]
    if decode_only:
        qsl[:n + 1] = np.arange(n + 1)
    else:
        qsl[0] = 0
        np.cumsum(ends - starts, out=qsl[1:n + 1])
    qsl[n + 1:] = total
    v["seq_lens"][:n] = ends
    v["seq_lens"][n:] = 0
    v["num_seqs"][0] = n
    block_tables = v["block_tables"]
    np.take(state.block_table, rows, axis=0, out=block_tables[:n])
    last = qsl[1:n + 1] - 1
    v["logits_indices"][:n] = last
    np.take(state.sampling, rows, axis=0, out=v["sampling"][:n])
    v["sampling"][n:] = 0  # padding rows: greedy, no filter
    v["sample_positions"][:n] = ends

    # Token ids: from the host, except a last token still on the device.
    prev = v["prev_rows"]
    prev[:] = -1
    on_device = ends > known
    prev[last[on_device]] = state.prev_sampled_row[rows[on_device]]
    input_ids = v["input_ids"][:total]
    if len(host_tokens) < total:
        input_ids[prev[:total] < 0] = host_tokens
    else:
        input_ids[:] = host_tokens

    if decode_only:
        req_of_token, pos = np.arange(n), starts
    else:  # [2, 3] tokens of requests starting at [5, 0] -> positions [5, 6, 0, 1, 2]
        req_of_token = np.repeat(np.arange(n), ends - starts)
        pos = np.arange(total, dtype=np.int32) - qsl[req_of_token] + starts[req_of_token]
    v["positions"][:total] = pos
    slots = v["slot_mapping"]
    slots[:total] = block_tables[req_of_token, pos // block_size] * block_size + pos % block_size
    slots[total:] = -1

    # Where this step's samples land, for the next step.
    state.prev_sampled_row[rows] = -1
    state.prev_sampled_row[rows[samples > 0]] = np.flatnonzero(samples)
