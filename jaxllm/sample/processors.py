"""The built-in logits processors, on device, in vLLM's order: the host's
token mask (structured outputs, multi-token bad words), then the request's fixed bias
row (logit_bias, allowed_token_ids, one-token bad words), then min_tokens (EOS and stop
ids masked), then the repetition, frequency and presence penalties.

Per-request state lives on the device, one row per request row of the runner
(`ProcessorState`): how often each token has been generated (updated inside the step
with the sampled ids, so asynchronous scheduling never waits for the host), which
tokens the prompt holds, the bias row and the stop ids. The host writes a request's
rows once, when it starts or resumes after preemption (`request_state_rows`).

With speculative decoding a request has a row of logits per draft token too: row m of a
request sees the counts as if its drafts before m had been generated, and only the tokens
it takes (the run of samples equal to the drafts, and the one after) are counted.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sample.sampler import ProcessorMetadata

WRITE_ROWS = 8  # requests per call of the row-writing executable (padded with dropped rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProcessorState:
    output_counts: jax.Array  # [num_rows, vocab] int32: occurrences of each token in the output
    prompt_mask: jax.Array    # [num_rows, vocab] bool: the token is in the prompt
    bias: jax.Array           # [num_rows, vocab] float32: added to the logits (-inf: never sampled)
    stop_mask: jax.Array      # [num_rows, vocab] bool: EOS and stop ids, masked until min_tokens

    @staticmethod
    def nbytes(num_rows: int, vocab_size: int) -> int:
        return num_rows * vocab_size * (4 + 1 + 4 + 1)


def zero_state(num_rows: int, vocab_size: int) -> ProcessorState:
    shape = (num_rows, vocab_size)
    return ProcessorState(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool), jnp.zeros(shape, jnp.float32),
                          jnp.zeros(shape, bool))


def request_state_rows(prompt_token_ids, output_token_ids, logit_bias: dict[int, float] | None,
                       allowed_token_ids: list[int] | None, banned_token_ids: list[int],
                       stop_token_ids, vocab_size: int) -> tuple[np.ndarray, ...]:
    """One request's rows of the ProcessorState, on the host: (output_counts [V] int32,
    prompt_mask [V] bool, bias [V] float32, stop_mask [V] bool)."""
    counts = np.bincount(np.asarray(output_token_ids, np.int64), minlength=vocab_size).astype(np.int32)
    prompt_mask = np.zeros(vocab_size, bool)
    prompt_mask[np.asarray(prompt_token_ids, np.int64)] = True
    bias = np.zeros(vocab_size, np.float32)
    if allowed_token_ids is not None:
        bias[:] = -np.inf
        bias[allowed_token_ids] = 0.0
    for token_id, value in (logit_bias or {}).items():
        bias[token_id] += value
    bias[banned_token_ids] = -np.inf
    stop_mask = np.zeros(vocab_size, bool)
    stop_mask[list(stop_token_ids)] = True
    return counts, prompt_mask, bias, stop_mask


def write_rows(state: ProcessorState, rows: jax.Array, counts, prompt_mask, bias, stop_mask) -> ProcessorState:
    """rows [WRITE_ROWS] int32 (out of range: skipped); the others [WRITE_ROWS, vocab]."""
    put = lambda array, values: array.at[rows].set(values, mode="drop")
    return ProcessorState(put(state.output_counts, counts), put(state.prompt_mask, prompt_mask),
                          put(state.bias, bias), put(state.stop_mask, stop_mask))


def apply_processors(logits: jax.Array, md: ProcessorMetadata, state: ProcessorState,
                     bitmask: jax.Array, num_speculative_tokens: int = 0) -> jax.Array:
    """logits [R, vocab] float32; bitmask [R, ceil(vocab / 32)] int32, bit t % 32 of word t // 32
    set where token t is allowed. Rows without processors come back unchanged."""
    vocab = logits.shape[-1]
    allowed = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = allowed.reshape(logits.shape[0], -1)[:, :vocab] != 0
    out = jnp.where(allowed, logits, -jnp.inf)
    out = out + state.bias[md.state_rows]
    num_output_tokens = md.positions - md.num_prompt_tokens
    out = jnp.where((num_output_tokens < md.min_tokens)[:, None] & state.stop_mask[md.state_rows], -jnp.inf, out)
    counts = state.output_counts[md.state_rows]
    rows = jnp.arange(counts.shape[0])
    for earlier, same_request in _earlier_rows(md, num_speculative_tokens):
        counts = counts.at[rows, md.drafts[earlier]].add(same_request.astype(jnp.int32))
    seen = state.prompt_mask[md.state_rows] | (counts > 0)
    penalty = md.repetition_penalty[:, None]
    out = jnp.where(seen, jnp.where(out > 0, out / penalty, out * penalty), out)
    out = out - md.frequency_penalty[:, None] * counts - md.presence_penalty[:, None] * (counts > 0)
    return jnp.where(md.processed[:, None], out, logits)


def count_sampled(state: ProcessorState, md: ProcessorMetadata, tokens: jax.Array,
                  num_speculative_tokens: int = 0) -> ProcessorState:
    """Count each request's sampled id [R] int32 in its output_counts row (with drafts, each id
    the request takes)."""
    taken = md.update_rows >= 0
    for earlier, same_request in _earlier_rows(md, num_speculative_tokens):
        taken &= ~same_request | (tokens[earlier] == md.drafts[earlier])
    rows = jnp.where(taken, md.update_rows, state.output_counts.shape[0])  # -1 would wrap around
    counts = state.output_counts.at[rows, tokens].add(1, mode="drop")
    return dataclasses.replace(state, output_counts=counts)


def _earlier_rows(md: ProcessorMetadata, num_speculative_tokens: int):
    """For each o in 1..num_speculative_tokens: (row - o, clamped at 0 [R] int32; whether that row
    is of the same request [R] bool), the rows whose drafts come before each row's position."""
    rows = jnp.arange(md.drafts.shape[0], dtype=jnp.int32)
    for o in range(1, num_speculative_tokens + 1):
        yield jnp.maximum(rows - o, 0), rows - o >= md.segment_starts
