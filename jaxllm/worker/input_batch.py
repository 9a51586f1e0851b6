"""The runner's persistent per-request rows, and packing a SchedulerOutput into the
static-shape inputs of one jitted step.

Shapes depend only on the token bucket T (a power of two up to
max_num_batched_tokens): per-request arrays are padded to R = min(T, max_num_seqs),
and the rows of logits (one per request, and with speculative decoding one per draft
token too) to L = min(T, R * (1 + num_speculative_tokens)), so each bucket is one
executable. Every input of a step lives in one int32 buffer
(floats and 64-bit seeds as their bits), so a step makes one host-to-device copy;
`BatchLayout` says where each field sits. The host buffers are allocated once per
bucket and written in place.
"""
import dataclasses
import math

import jax
import numpy as np

from jaxllm.contracts.step import DRAFT_ON_DEVICE, NewRequestData, SchedulerOutput
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.sample.sampler import (COLUMN, FLOAT_COLUMNS, NUM_REQUEST_WORDS, NUM_SAMPLING_WORDS, SampleMode,
                                   needs_processors, sample_mode)
from jaxllm.utils import cdiv


_ALIGN = 64  # int32 words: 256 bytes
_POSITION, _STATE_ROW, _UPDATE_ROW = COLUMN["position"], COLUMN["state_row"], COLUMN["update_row"]
_DRAFT, _SEGMENT_START = COLUMN["draft_token"], COLUMN["segment_start"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    input_ids: jax.Array       # [T] int32
    # [T] int32: where the previous step's device tokens hold this token (ModelRunner._prev_tokens), or -1
    prev_rows: jax.Array
    positions: jax.Array       # [T] int32
    logits_indices: jax.Array  # [L] int32: the tokens whose logits are sampled: each request's last, and its drafts'
    attention: AttentionMetadata
    sampling: jax.Array        # [L, NUM_SAMPLING_WORDS] int32: the sampler's words (sampler.SAMPLING_COLUMNS)
    first_rows: jax.Array      # [R] int32: each request's first row of logits if it samples, else -1 (a draft model's)
    # [R] int32, an EAGLE head's: after a prefill chunk that does not sample, the id of the token after it, else -1
    next_token_ids: jax.Array | None = None
    lora_slots: jax.Array | None = None  # [T] int32, with LoRA: each token's adapter slot, -1 for none


class BatchLayout:
    """Offsets and shapes of a bucket's fields in its int32 buffer."""

    def __init__(self, num_tokens: int, num_reqs: int, max_blocks_per_seq: int, num_groups: int = 1,
                 num_rows: int | None = None, next_tokens: bool = False, lora: bool = False):
        """num_rows: of logits (L; default num_reqs); next_tokens: with the next_token_ids field (EAGLE's);
        lora: with the lora_slots field."""
        T, R, G, L = num_tokens, num_reqs, num_groups, num_rows or num_reqs
        shapes = {
            "input_ids": (T,), "prev_rows": (T,), "positions": (T,), "slot_mapping": (G, T),
            "logits_indices": (L,), "query_start_loc": (R + 1,), "seq_lens": (R,), "num_seqs": (1,),
            "sampling": (L, NUM_SAMPLING_WORDS), "block_tables": (G, R, max_blocks_per_seq), "first_rows": (R,),
        }
        if next_tokens:
            shapes["next_token_ids"] = (R,)
        if lora:
            shapes["lora_slots"] = (T,)
        self.num_tokens, self.num_reqs, self.num_rows = T, R, L
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            self.fields[name] = (offset, shape)
            # Kernels (Mosaic GPU) take their operands 256-byte aligned: XLA passes slices in place.
            offset += cdiv(math.prod(shape), _ALIGN) * _ALIGN
        self.size = offset

    def replace(self, buffer: jax.Array, **fields: jax.Array) -> jax.Array:
        """Inside the jitted step: `buffer` [size] int32 with new values of `fields`."""
        for name, value in fields.items():
            offset, _ = self.fields[name]
            buffer = jax.lax.dynamic_update_slice(buffer, value.reshape(-1), (offset,))
        return buffer

    def host_views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """numpy views of `buffer` [size] int32, one per field."""
        return {name: buffer[offset:offset + math.prod(shape)].reshape(shape)
                for name, (offset, shape) in self.fields.items()}

    def unpack(self, buffer: jax.Array, decodes_only: bool = False) -> StepBatch:
        """Inside the jitted step: the StepBatch that `buffer` [size] int32 holds (decodes_only: what
        the host knows of it, AttentionMetadata.decodes_only)."""
        def field(name):
            offset, shape = self.fields[name]
            return buffer[offset:offset + math.prod(shape)].reshape(shape)

        return StepBatch(
            input_ids=field("input_ids"), prev_rows=field("prev_rows"), positions=field("positions"),
            logits_indices=field("logits_indices"),
            attention=AttentionMetadata(slot_mapping=field("slot_mapping"), query_start_loc=field("query_start_loc"),
                                        seq_lens=field("seq_lens"), block_tables=field("block_tables"),
                                        num_seqs=field("num_seqs"), decodes_only=decodes_only),
            sampling=field("sampling"), first_rows=field("first_rows"),
            next_token_ids=field("next_token_ids") if "next_token_ids" in self.fields else None,
            lora_slots=field("lora_slots") if "lora_slots" in self.fields else None)


class HostBuffers:
    """Each token bucket's packed buffers, one per step in flight, taken in turn: a buffer is
    rewritten only once the step that read it has finished."""
    def __init__(self, layouts: dict[int, BatchLayout], steps_in_flight: int):
        self._buffers = {t: [(b, layout.host_views(b)) for b in (np.zeros(layout.size, np.int32)
                                                                  for _ in range(steps_in_flight))]
                         for t, layout in layouts.items()}
        self._num_steps = 0

    def next(self, token_bucket: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The bucket's next buffer and its views by field."""
        self._num_steps += 1
        buffers = self._buffers[token_bucket]
        return buffers[self._num_steps % len(buffers)]

    def first(self, token_bucket: int) -> np.ndarray:
        """A buffer of the bucket, for lowering (its shape is what counts)."""
        return self._buffers[token_bucket][0][0]


class RequestRows:
    """The runner's persistent host state, one row per request that holds KV blocks, made from
    its NewRequestData: its block table in each KV cache group, its sampling words
    (sampling_row), SampleMode, whether the sampler runs the logits processors for it, how many
    logprobs it wants, whether its steps wait for the core's token masks, and where its tokens
    start in the last step's device tokens (prev_offset). A step gathers its requests' rows in
    one copy each and writes only the blocks the scheduler added: packing costs O(new blocks),
    not O(context). A request gives its row back when it finishes or is preempted, so
    max_num_seqs rows always suffice (and index the device's ProcessorState)."""

    def __init__(self, max_blocks_per_seq: int, num_rows: int, num_groups: int = 1):
        self.num_rows = num_rows
        self.block_table = np.zeros((num_groups, num_rows, max_blocks_per_seq), np.int32)
        self.sampling = np.zeros((num_rows, NUM_REQUEST_WORDS), np.int32)
        self.sample_mode = np.zeros(num_rows, np.int8)
        self.processed = np.zeros(num_rows, bool)
        self.num_logprobs = np.full(num_rows, -1, np.int32)  # SamplingParams.logprobs, -1 for None
        self.routed_experts = np.zeros(num_rows, bool)  # SamplingParams.return_routed_experts
        self.host_masked = np.zeros(num_rows, bool)
        self.prev_offset = np.full(num_rows, -1, np.int32)
        self._num_blocks = np.zeros((num_groups, num_rows), np.int32)  # a group's table entries of a row
        self._rows: dict[str, int] = {}  # request id -> its row
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.prompts: dict[str, list[int]] = {}  # the prompts of requests that asked for prompt logprobs

    def update(self, sched: SchedulerOutput) -> tuple[np.ndarray, list[tuple[int, NewRequestData]], list[int]]:
        """Apply the step's finished, preempted and new requests and its new blocks. Returns each
        scheduled request's row, the (row, data) pairs that took a row this step, and the rows
        given back."""
        removed = []
        for request_id in (*sched.finished_req_ids, *sched.preempted_req_ids):
            row = self._rows.pop(request_id, None)
            self.prompts.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)
                removed.append(row)
        added = []
        for new in sched.new_requests:
            row = self._rows[new.req_id] = self._new_row()
            params = new.sampling_params
            self.sampling[row] = sampling_row(new)
            self.sample_mode[row] = sample_mode(params)
            self.processed[row] = self.sampling[row, COLUMN["processed"]]
            self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
            self.routed_experts[row] = params.return_routed_experts
            self.host_masked[row] = new.host_masked
            self._num_blocks[:, row] = 0
            if params.prompt_logprobs is not None:
                self.prompts[new.req_id] = new.prompt_token_ids
            added.append((row, new))
        rows = []
        for s in sched.scheduled:
            row = self._rows[s.req_id]
            for g, block_ids in enumerate(s.new_block_ids):
                if block_ids:
                    n = self._num_blocks[g, row]
                    self.block_table[g, row, n:n + len(block_ids)] = block_ids
                    self._num_blocks[g, row] = n + len(block_ids)
            rows.append(row)
        return np.array(rows, np.int32), added, removed

    def _new_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"more than {self.num_rows} requests hold rows: the scheduler runs at most "
                               "max_num_seqs, and a preempted or finished request gives its row back")
        return self._free_rows.pop()

    def batch_sample_mode(self, rows: np.ndarray) -> SampleMode:
        return SampleMode(int(self.sample_mode[rows].max()))

    def clear(self) -> None:
        self._rows.clear()
        self.prompts.clear()
        self._free_rows = list(range(self.num_rows - 1, -1, -1))


def sampling_row(new: NewRequestData) -> np.ndarray:
    """A request's words of the sampler's inputs [NUM_REQUEST_WORDS] int32, in the order of
    sampler.SAMPLING_COLUMNS (floats as their bits). Made once per request."""
    params = new.sampling_params
    row = np.zeros(NUM_REQUEST_WORDS, np.int32)
    floats = [params.temperature, params.top_p, params.min_p, params.presence_penalty,
              params.frequency_penalty, params.repetition_penalty]
    row[FLOAT_COLUMNS] = np.array(floats, np.float32).view(np.int32)
    int32_max = np.iinfo(np.int32).max
    row[COLUMN["top_k"]] = min(params.top_k, int32_max)
    seed_words = np.array([new.seed >> 32, new.seed & 0xFFFFFFFF], np.uint32).view(np.int32)
    row[COLUMN["seed_high"]], row[COLUMN["seed_low"]] = seed_words
    row[COLUMN["min_tokens"]] = min(params.min_tokens, int32_max)
    row[COLUMN["num_prompt_tokens"]] = len(new.prompt_token_ids)
    # Whether the sampler runs the logits processors for it (sample/processors.py); a host-masked
    # request's mask is applied there too.
    row[COLUMN["processed"]] = needs_processors(params) or bool(new.banned_token_ids) or new.host_masked
    return row


SMALLEST_BUCKET = 16


def token_buckets(max_num_batched_tokens: int, single_token: bool = False) -> list[int]:
    """Powers of two from SMALLEST_BUCKET, then max_num_batched_tokens; single_token: a bucket of one
    token first, for a lone request's decode step (its attention splits the context over the whole
    GPU where a bucket of 16 request slots would plan for 16 requests, pallas_attention.plan)."""
    buckets, b = [1] if single_token and max_num_batched_tokens > 1 else [], SMALLEST_BUCKET
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


def request_bucket(token_bucket: int, max_num_seqs: int) -> int:
    return min(token_bucket, max_num_seqs)


def logit_rows(token_bucket: int, max_num_seqs: int, num_speculative_tokens: int = 0) -> int:
    """L: each row is a scheduled token, and a request has at most 1 + num_speculative_tokens."""
    return min(token_bucket, request_bucket(token_bucket, max_num_seqs) * (1 + num_speculative_tokens))


def fill_padding(v: dict[str, np.ndarray]) -> None:
    """An all-padding batch (warm-up compiles with these): no request, no KV writes."""
    for view in v.values():
        view[...] = 0
    v["slot_mapping"][...] = -1
    v["prev_rows"][:] = -1
    v["first_rows"][:] = -1
    if "next_token_ids" in v:
        v["next_token_ids"][:] = -1
    if "lora_slots" in v:
        v["lora_slots"][:] = -1


def pack(sched: SchedulerOutput, rows: np.ndarray, state: RequestRows, v: dict[str, np.ndarray],
         block_size: int, table_width: int = 0, lora_slots: np.ndarray | None = None) -> np.ndarray | None:
    """Write the scheduled requests (at `rows` of `state`) into a bucket's host views `v`.
    A request's last token, and with a drafter its drafts (DRAFT_ON_DEVICE), may be ones the
    previous step is still making on the device: the step then reads them there (`prev_rows`:
    their offsets in that step's device tokens) instead of the host. Those are its sampled ids,
    or with a drafter its table of `table_width` (2 + k) words per request (worker/draft_inputs.py).
    lora_slots [n] int32: with LoRA, each scheduled request's adapter slot (-1: none).
    Returns each request's first row of logits when a request has drafts (its rows are its
    drafts' positions and its last token's), else None (row i is request i's)."""
    reqs = sched.scheduled
    n, total = len(reqs), sched.num_scheduled_tokens
    # One pass over the requests: their numbers, and the token ids the host has for the step.
    numbers, host_tokens, drafts = [], [], []
    for s in reqs:
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        num_drafts = len(s.draft_token_ids)
        drafts_known = num_drafts and s.draft_token_ids[0] != DRAFT_ON_DEVICE
        known = start + len(s.token_ids) + (num_drafts if drafts_known else 0)  # the ids the host has end here
        numbers.append((start, end, known, s.samples, num_drafts))
        host_tokens += s.token_ids
        if num_drafts:
            if drafts_known:
                host_tokens += s.draft_token_ids
            drafts += s.draft_token_ids  # DRAFT_ON_DEVICE ones are read on the device (draft_inputs.py)
    starts, ends, known, samples, num_drafts = np.array(numbers, np.int32).T
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
    np.take(state.block_table, rows, axis=1, out=block_tables[:, :n])
    last = qsl[1:n + 1] - 1
    samples = samples.astype(bool)
    first_rows = None
    if drafts:  # a row of logits per draft before each such request's last token
        per_request = num_drafts + 1
        first_rows = np.zeros(n, np.int32)
        np.cumsum(per_request[:-1], out=first_rows[1:])
        num_rows = int(per_request.sum())
        request_of_row = np.repeat(np.arange(n), per_request)
        before_last = first_rows[request_of_row] + num_drafts[request_of_row] - np.arange(num_rows, dtype=np.int32)
        v["logits_indices"][:num_rows] = last[request_of_row] - before_last
        positions = ends[request_of_row] - before_last
        row_drafts = np.full(num_rows, -1, np.int32)
        row_drafts[before_last > 0] = drafts
        segment_starts = first_rows[request_of_row]
    else:
        num_rows, request_of_row = n, slice(None)
        v["logits_indices"][:n] = last
        positions, row_drafts, segment_starts = ends, -1, np.arange(n)
    row_state = rows[request_of_row]
    sampling = v["sampling"]
    sampling[:num_rows, :NUM_REQUEST_WORDS] = state.sampling[row_state]
    sampling[:num_rows, _POSITION] = positions
    sampling[:num_rows, _STATE_ROW] = row_state
    # Only a request with processors that samples this step counts its token (row + 1; 0: nowhere).
    sampling[:num_rows, _UPDATE_ROW] = np.where(samples[request_of_row] & state.processed[row_state], row_state + 1, 0)
    sampling[:num_rows, _DRAFT] = row_drafts
    sampling[:num_rows, _SEGMENT_START] = segment_starts
    sampling[num_rows:] = 0  # padding rows: greedy, no filter, no processors
    v["first_rows"][:n] = np.where(samples, np.arange(n) if first_rows is None else first_rows, -1)
    v["first_rows"][n:] = -1
    if "next_token_ids" in v:
        v["next_token_ids"][:n] = [s.next_token_id for s in reqs]
        v["next_token_ids"][n:] = -1

    if decode_only:
        req_of_token, pos = np.arange(n), starts
    else:  # [2, 3] tokens of requests starting at [5, 0] -> positions [5, 6, 0, 1, 2]
        req_of_token = np.repeat(np.arange(n), ends - starts)
        pos = np.arange(total, dtype=np.int32) - qsl[req_of_token] + starts[req_of_token]
    v["positions"][:total] = pos
    if lora_slots is not None:
        v["lora_slots"][:total] = lora_slots[req_of_token]
        v["lora_slots"][total:] = -1
    slots = v["slot_mapping"]
    slots[:, :total] = block_tables[:, req_of_token, pos // block_size] * block_size + pos % block_size
    slots[:, total:] = -1

    # Token ids: from the host, but those past what it knows of a request, which the previous step
    # is still making: at known 7 and offset 40, positions [7, 8, 9] -> prev_rows [40, 41, 42].
    known_at = known[req_of_token]
    on_device = pos >= known_at
    prev = v["prev_rows"]
    prev[:total] = np.where(on_device, state.prev_offset[rows[req_of_token]] + pos - known_at, -1)
    prev[total:] = -1
    input_ids = v["input_ids"][:total]
    if len(host_tokens) < total:
        input_ids[~on_device] = host_tokens
    else:
        input_ids[:] = host_tokens

    # Where this step's tokens will be on the device, for the next step: a request's sample at its
    # first row of logits, or with a drafter its row of the drafter's table (its last token first).
    state.prev_offset[rows] = -1
    if table_width:
        state.prev_offset[rows[samples]] = np.flatnonzero(samples) * table_width
    else:  # with host drafts (synchronous scheduling) the next step knows every token
        fed = samples & (num_drafts == 0)
        state.prev_offset[rows[fed]] = np.flatnonzero(fed) if first_rows is None else first_rows[fed]
    return first_rows


_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per call of the prompt-logprobs executable


def prompt_logprobs_chunk(token_bucket: int) -> int:
    return min(_PROMPT_LOGPROBS_CHUNK, token_bucket)


def prompt_logprob_inputs(sched: SchedulerOutput, v: dict[str, np.ndarray], prompts: dict[str, list[int]],
                          token_bucket: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[tuple[int, int]]]:
    """The step's prompt positions whose logprobs a request asked for (ScheduledRequest.prompt_logprobs),
    from its packed views `v` and the requests' prompts, in chunks of the executable's size:
    ([(token indices [C], prompt ids at those positions [C])], [(scheduled request index, number of positions)])."""
    indices, targets, segments = [], [], []
    for i, s in enumerate(sched.scheduled):
        if s.prompt_logprobs is None:
            continue
        lo, hi = s.prompt_logprobs  # position p's logprobs: from the logits of token p - 1
        first = int(v["query_start_loc"][i]) + lo - 1 - s.num_computed_tokens
        indices.extend(range(first, first + hi - lo))
        targets.extend(prompts[s.req_id][lo:hi])
        segments.append((i, hi - lo))
    chunk = prompt_logprobs_chunk(token_bucket)
    inputs = []
    for start in range(0, len(indices), chunk):
        pair = np.zeros((2, chunk), np.int32)
        part = slice(start, start + chunk)
        pair[0, :len(indices[part])], pair[1, :len(targets[part])] = indices[part], targets[part]
        inputs.append((pair[0], pair[1]))
    return inputs, segments
