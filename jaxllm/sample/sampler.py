"""On-device sampling, jitted after the step's forward pass.

Per request: temperature (0 = greedy), top-k (<= 0 disables), top-p, min-p, and a
stateless key `fold_in(key(seed), position)`, so a request's samples depend only
on its own seed and position, never on what else is in the batch. A batch with a
request that needs them first runs the logits processors (jaxllm/sample/processors.py:
penalties, logit bias, allowed and bad words, min_tokens, structured outputs' masks).

What the batch needs is decided on the host (`SampleMode`, a static argument), not
with `lax.cond`: XLA on GPU runs a conditional by reading its predicate back to the
host, which would stall the host until the device reached it, every step.
"""
import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels import batch_invariant
from jaxllm.sampling_params import SamplingParams


class SampleMode(enum.IntEnum):
    """The least work that samples a batch right: all greedy skips the random draw; no
    top-p or min-p skips the filter; no top-k skips its threshold's search. A batch's mode
    is the highest of its requests'. Whether the batch runs the logits processors is
    decided beside it (needs_processors)."""
    GREEDY = 0
    RANDOM = 1
    NUCLEUS = 2   # top-p and min-p
    FILTERED = 3  # top-k too


def needs_processors(params: SamplingParams) -> bool:
    """Whether a request changes its logits before sampling (processors.apply_processors)."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
            or params.min_tokens > 0 or bool(params.logit_bias) or params.allowed_token_ids is not None
            or bool(params.bad_words) or params.structured_outputs is not None)


def sample_mode(params: SamplingParams) -> SampleMode:
    if params.temperature == 0.0:
        return SampleMode.GREEDY
    if params.top_k > 0:
        return SampleMode.FILTERED
    if params.top_p < 1.0 or params.min_p > 0.0:
        return SampleMode.NUCLEUS
    return SampleMode.RANDOM


# The columns of a step's sampling words [num_rows, NUM_SAMPLING_WORDS] int32 (floats as their
# bits), one row per position sampled: a request's, and with speculative decoding one more per
# draft token. The first ones are a request's for its life (Request.sampling_row); the last five the
# step's: "update_row" is the row + 1 that counts the sampled token, so all-zero words are an inert
# padding row; "draft_token" is the draft this row's sample is checked against (-1: none, the
# request's last row), "segment_start" the request's first row.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed_high", "seed_low",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                    "num_prompt_tokens", "processed",
                    "position", "state_row", "update_row", "draft_token", "segment_start")
NUM_REQUEST_WORDS, NUM_SAMPLING_WORDS = SAMPLING_COLUMNS.index("position"), len(SAMPLING_COLUMNS)
COLUMN = {name: i for i, name in enumerate(SAMPLING_COLUMNS)}
FLOAT_COLUMNS = [COLUMN[name] for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty")]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [num_reqs] float32, 0 for greedy
    top_k: jax.Array        # [num_reqs] int32, <= 0 disables
    top_p: jax.Array        # [num_reqs] float32, 1 disables
    min_p: jax.Array        # [num_reqs] float32, 0 disables
    seeds: jax.Array        # [num_reqs, 2] uint32: a 64-bit seed as (high, low) words
    positions: jax.Array    # [num_reqs] int32: position of the token being sampled

    @classmethod
    def from_words(cls, words: jax.Array) -> "SamplingMetadata":
        """From a step's sampling words [num_reqs, NUM_SAMPLING_WORDS] int32."""
        column = lambda name: words[:, COLUMN[name]]
        as_f32 = lambda name: jax.lax.bitcast_convert_type(column(name), jnp.float32)
        seeds = jax.lax.bitcast_convert_type(words[:, COLUMN["seed_high"]:COLUMN["seed_low"] + 1], jnp.uint32)
        return cls(as_f32("temperature"), column("top_k"), as_f32("top_p"), as_f32("min_p"), seeds,
                   column("position"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProcessorMetadata:
    """What the logits processors read per request (jaxllm/sample/processors.py)."""
    presence_penalty: jax.Array    # [num_reqs] float32
    frequency_penalty: jax.Array   # [num_reqs] float32
    repetition_penalty: jax.Array  # [num_reqs] float32
    min_tokens: jax.Array          # [num_reqs] int32
    num_prompt_tokens: jax.Array   # [num_reqs] int32
    processed: jax.Array           # [num_reqs] bool: the request has processors (and its state row is written)
    positions: jax.Array           # [num_reqs] int32: position of the token being sampled
    state_rows: jax.Array          # [num_reqs] int32: the request's row of the ProcessorState
    update_rows: jax.Array         # [num_reqs] int32: the row that counts the sampled token, -1 for none
    drafts: jax.Array              # [num_reqs] int32: the draft the row's sample is checked against, -1: none
    segment_starts: jax.Array      # [num_reqs] int32: the first row of the row's request

    @classmethod
    def from_words(cls, words: jax.Array) -> "ProcessorMetadata":
        column = lambda name: words[:, COLUMN[name]]
        as_f32 = lambda name: jax.lax.bitcast_convert_type(column(name), jnp.float32)
        return cls(as_f32("presence_penalty"), as_f32("frequency_penalty"), as_f32("repetition_penalty"),
                   column("min_tokens"), column("num_prompt_tokens"), column("processed") != 0,
                   column("position"), column("state_row"), column("update_row") - 1, column("draft_token"),
                   column("segment_start"))


def sample(logits: jax.Array, md: SamplingMetadata, mode: SampleMode = SampleMode.FILTERED) -> jax.Array:
    """logits [num_reqs, vocab] float32 -> token ids [num_reqs] int32. `mode` must be at
    least the batch's (FILTERED samples any batch). In batch-invariant mode under tensor parallelism
    it runs whole on each device (kernels/batch_invariant.py): the filters' sums over the vocabulary
    add in one order, not in a cross-device all-reduce's."""
    return batch_invariant.on_every_device(functools.partial(_sample, mode=mode))(logits, md)


def _sample(logits: jax.Array, md: SamplingMetadata, mode: SampleMode) -> jax.Array:
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == SampleMode.GREEDY:
        return greedy_tokens
    return jnp.where(md.temperature == 0.0, greedy_tokens, _random_sample(logits, md, mode))


def _random_sample(logits, md, mode: SampleMode):
    temperature = jnp.where(md.temperature == 0.0, 1.0, md.temperature)
    logits = logits / temperature[:, None]
    if mode >= SampleMode.NUCLEUS:
        logits = _filter(logits, md, with_top_k=mode == SampleMode.FILTERED)
    keys = jax.vmap(_request_key)(md.seeds, md.positions)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(logits + gumbel, axis=-1).astype(jnp.int32)


def _request_key(seed, position):
    key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    return jax.random.fold_in(key, position)


def _filter(logits, md, with_top_k: bool = True):
    """Mask to -inf every token under min-p, then outside top-k (unless `with_top_k` is off:
    no request has one), then outside the top-p nucleus of what is left (vLLM's order). Each
    kept set is every token at or above a threshold, found without a sort (a sort of [256,
    128k] takes 2.5 ms on an H200): the top-k logit and the top-p probability are searched
    bit by bit (_search)."""
    vocab = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= md.min_p[:, None] * probs.max(-1, keepdims=True)
    num_reqs = logits.shape[0]
    if with_top_k:
        k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, vocab), vocab)
        # The k-th largest logit: the largest t with at least k logits >= t (ties at it stay).
        ordered = _ordered_bits(logits)
        kth = _search(lambda t: jnp.sum(ordered >= t[:, None], -1) >= k, 32, num_reqs)
        keep &= ordered >= kth[:, None]
    # The nucleus: the largest probability t whose tokens >= t hold top_p of the mass left
    # (vLLM's: a token stays while the mass before it is < top_p); top_p = 1 keeps all.
    bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)  # non-negative floats order as their bits
    mass = jnp.sum(jnp.where(keep, probs, 0.0), -1)
    nucleus = _search(lambda t: jnp.sum(jnp.where(keep & (bits >= t[:, None]), probs, 0.0), -1)
                      >= md.top_p * mass, 30, num_reqs)  # probabilities <= 1.0 = 0x3F800000 < 2**30
    keep &= (bits >= nucleus[:, None]) | (md.top_p[:, None] >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 that order as the floats do: negatives flipped, then the sign bit set."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


_SEARCH_BITS = 3  # bits decided per pass: 7 candidate thresholds, summed in one pass over the row


def _searches_in_a_loop() -> bool:
    return jax.default_backend() == "cpu"


def _search(ok, num_bits: int, num_rows: int) -> jax.Array:
    """The largest t [R] uint32 below 2**num_bits with ok(t) [R] bool, for an ok that holds
    up to some t and not above it, and holds at 0. On a GPU, decides _SEARCH_BITS bits per pass
    from the top (of the candidate prefixes, as many hold as the next digit's value), the passes
    unrolled: a loop there syncs with the host each pass. On a CPU, where XLA compiles each
    unrolled reduction as a kernel of its own (most of a filtered sampler's compile), one bit a
    pass in a loop: one reduction to compile."""
    if _searches_in_a_loop():
        def one_bit(i, prefix):
            candidate = prefix + (jnp.uint32(1) << (num_bits - 1 - i).astype(jnp.uint32))
            return jnp.where(ok(candidate), candidate, prefix)
        return jax.lax.fori_loop(0, num_bits, one_bit, jnp.zeros(num_rows, jnp.uint32))

    def one_pass(prefix, shift: int, step: int):
        holds = jnp.stack([ok(prefix + (jnp.uint32(j) << shift)) for j in range(1, 2 ** step)], -1)
        return prefix + (holds.sum(-1, dtype=jnp.uint32) << shift)

    first = num_bits % _SEARCH_BITS or _SEARCH_BITS  # the top pass decides the bits left over
    prefix = one_pass(jnp.zeros(num_rows, jnp.uint32), num_bits - first, first)
    for i in reversed(range((num_bits - first) // _SEARCH_BITS)):
        prefix = one_pass(prefix, i * _SEARCH_BITS, _SEARCH_BITS)
    return prefix
