"""Mamba2's selective state space over the engine's ragged batch, in plain JAX: the chunked SSD
scan (state-space duality) for prefill chunks, the one-step update for decodes.

Per head h of a request, with a_t = dt_t * A_h (A < 0) and a state S_t [head_dim, state_size]:
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t
from the request's state S_0 (zeros on its first chunk; the skip D x_t is the caller's).

The scan splits each request's tokens into chunks of Q from its first token (a chunk never holds
two requests). With cum the running sum of a within a chunk, each chunk gives
    within:   y_i  = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j      a masked quadratic form
    its own:  U_c  = sum_j exp(cum_last - cum_j) dt_j x_j B_j^T                 what it adds to the state
    between:  S_c  = exp(cum_last) S_{c-1} + U_c,   y_i += exp(cum_i) S_{c-1} C_i
the chunk-to-chunk recurrence an associative scan, restarted from S_0 at each request's first
chunk. A request of one token (a decode, or a one-token prefill chunk) takes the update instead.

The batch is the attention kernels' (kernels/reference.py): tokens flattened, request i's being
[query_start_loc[i], query_start_loc[i + 1]), the first num_seqs requests real.
"""
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.kernels.reference import scatter_index
from jaxllm.utils import cdiv


class ChunkLayout(NamedTuple):
    """Where each chunk of the prefill requests lies on the token axis."""
    tokens: jax.Array    # [num_chunks, Q] int32: the chunk's token indices
    mask: jax.Array      # [num_chunks, Q] bool: a real token of the chunk (its request's, in order)
    request: jax.Array   # [num_chunks] int32: the chunk's request
    first: jax.Array     # [num_chunks] bool: the first chunk of its request
    last: jax.Array      # [num_reqs] int32: each request's last chunk (of a prefill request)


FEW_PARTIAL_CHUNKS = 2  # usual_chunks: the prefill requests' partial chunks it takes


def max_chunks(num_tokens: int, num_reqs: int, chunk_size: int) -> int:
    """The most chunks a batch holds: each prefill request (two tokens or more) adds at most one
    partial chunk to the full ones."""
    return cdiv(num_tokens, chunk_size) + min(num_reqs, num_tokens // 2)


def usual_chunks(num_tokens: int, num_reqs: int, chunk_size: int) -> int:
    """The chunk slots of a step of a few prefill requests (the usual mix): the full chunks and a few
    partial ones. Also the most chunks whose terms ragged_ssd makes at once (its memory)."""
    return min(max_chunks(num_tokens, num_reqs, chunk_size), cdiv(num_tokens, chunk_size) + FEW_PARTIAL_CHUNKS)


def scan_bytes(num_tokens: int, num_reqs: int, chunk_size: int, num_heads: int, head_dim: int,
               state_size: int) -> int:
    """A bound on ragged_ssd's transient memory at a bucket of num_tokens tokens and num_reqs requests
    (fp32): a few [usual, Q, Q, H] products of the chunks whose terms it makes at once, over all its
    chunks a few [Q, H, P] outputs and [H, P, N] states, and a few [T, H, P] outputs. Within 1.06-1.41x
    of what XLA's memory analysis reports, from tiny shapes to Mamba2-2.7B's at 8192 tokens."""
    q = min(chunk_size, num_tokens)
    chunks, usual = max_chunks(num_tokens, num_reqs, q), usual_chunks(num_tokens, num_reqs, q)
    return 4 * (4 * usual * q * q * num_heads + 3 * chunks * num_heads * head_dim * (q + state_size)
                + 4 * num_tokens * num_heads * head_dim)


def chunk_layout(query_lens, query_start_loc, num_tokens: int, chunk_size: int,
                 num_chunks: int | None = None) -> ChunkLayout:
    """The chunks of the requests of query_lens [R] int32 (0 for padding) tokens two or more, in
    num_chunks slots (default max_chunks; fewer only where the requests need no more)."""
    num_reqs = query_lens.shape[0]
    num_chunks = num_chunks or max_chunks(num_tokens, num_reqs, chunk_size)
    per_request = jnp.where(query_lens >= 2, (query_lens + chunk_size - 1) // chunk_size, 0)
    ends = jnp.cumsum(per_request)
    # per_request [2, 0, 1] -> ends [2, 2, 3]: chunks [0, 1, 2] are requests [0, 0, 2]
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    request = jnp.minimum(jnp.searchsorted(ends, chunk, side="right", method="compare_all"), num_reqs - 1)
    index = chunk - (ends - per_request)[request]  # the chunk's place in its request
    start = query_start_loc[request] + index * chunk_size
    length = jnp.where(chunk < ends[-1], jnp.minimum(query_lens[request] - index * chunk_size, chunk_size), 0)
    offsets = jnp.arange(chunk_size, dtype=jnp.int32)
    return ChunkLayout(tokens=start[:, None] + offsets, mask=offsets < length[:, None],
                       request=request.astype(jnp.int32), first=index == 0, last=(ends - 1).astype(jnp.int32))


def _per_head(bc, num_heads: int):
    """B or C [..., groups, state_size] -> [..., num_heads, state_size]: head h reads group h // (heads / groups)."""
    return jnp.repeat(bc, num_heads // bc.shape[-2], axis=-2)


def chunk_terms(xc, dtc, cum, bc, cc):
    """The two terms each chunk makes alone, in plain JAX: xc [c, Q, H, P], dtc and cum [c, Q, H], bc
    and cc [c, Q, G, N] (per group), float32 -> (y within the chunk [c, Q, H, P], its own state term
    U_c [c, H, P, N]). kernels/pallas_ssd.py computes the same in one Pallas kernel."""
    num_heads = dtc.shape[2]
    bc, cc = _per_head(bc, num_heads), _per_head(cc, num_heads)     # [c, Q, H, N]
    q = xc.shape[1]
    causal = (jnp.arange(q)[:, None] >= jnp.arange(q)[None, :])[None, :, :, None]
    decay = jnp.exp(jnp.where(causal, cum[:, :, None, :] - cum[:, None, :, :], -jnp.inf))  # [c, i, j, H]
    scores = jnp.einsum("cihn,cjhn->cijh", cc, bc) * decay
    y = jnp.einsum("cijh,cjh,cjhp->cihp", scores, dtc, xc)
    to_end = jnp.exp(cum[:, -1:] - cum) * dtc                        # [c, Q, H]
    return y, jnp.einsum("cjh,cjhn,cjhp->chpn", to_end, bc, xc)


def _in_groups(f, group: int, *chunked):
    """f over the chunk axis of `chunked` (arrays [c, ...]) `group` chunks at a time, in a loop: the
    transient memory of f's [c, Q, Q, H] products stays that of one group's. Padding chunks (zeros) are
    dropped from f's results."""
    num_chunks = chunked[0].shape[0]
    if num_chunks <= group:
        return f(*chunked)
    n = cdiv(num_chunks, group)
    grouped = [jnp.pad(a, [(0, n * group - num_chunks)] + [(0, 0)] * (a.ndim - 1)).reshape(n, group, *a.shape[1:])
               for a in chunked]
    out = jax.lax.map(lambda a: f(*a), grouped)
    return jax.tree.map(lambda a: a.reshape(n * group, *a.shape[2:])[:num_chunks], out)


def ssd_chunk_scan(x, dt, A, B, C, initial_states, layout: ChunkLayout, terms=chunk_terms, group: int | None = None):
    """The prefill requests' outputs and final states, chunk by chunk (the module's docstring).

    x [T, H, P], dt [T, H] (after softplus), A [H], B, C [T, G, N], initial_states [R, H, P, N]: all
    float32; terms: chunk_terms or its Pallas kernel; group: the most chunks whose terms are made at
    once (None: all). Returns (y [T, H, P]: zeros outside the chunks, final states [R, H, P, N]: of
    each request's last chunk, for prefill requests)."""
    num_tokens, num_heads = dt.shape
    tokens = jnp.where(layout.mask, layout.tokens, 0)

    def decay(tokens, mask):
        dtc = jnp.where(mask[..., None], dt[tokens], 0.0)            # [c, Q, H]: masked tokens change nothing
        return dtc, jnp.cumsum(dtc * A, axis=1)                      # cum [c, Q, H], decreasing

    def own_terms(tokens, mask):
        dtc, cum = decay(tokens, mask)
        xc = jnp.where(mask[..., None, None], x[tokens], 0.0)        # [c, Q, H, P]
        y, own = terms(xc, dtc, cum, B[tokens], C[tokens])
        return y, own, cum[:, -1]

    y, own, cum_last = _in_groups(own_terms, group or tokens.shape[0], tokens, layout.mask)
    chunk_decay = jnp.exp(cum_last)[..., None, None]                 # [c, H, 1, 1]
    start = initial_states[layout.request]
    first = layout.first[:, None, None, None]
    # S_c = g_c S_{c-1} + b_c, restarted at a request's first chunk (g = 0, S_0 folded into b).
    gates = jnp.where(first, 0.0, chunk_decay)
    adds = own + jnp.where(first, chunk_decay * start, 0.0)

    def combine(earlier, later):
        return earlier[0] * later[0], later[0] * earlier[1] + later[1]

    _, states = jax.lax.associative_scan(combine, (gates, adds))
    before = jnp.where(first, start, jnp.concatenate([start[:1], states[:-1]]))  # S_{c-1}

    def from_before(y, before, tokens, mask):
        cum = decay(tokens, mask)[1]
        return y + jnp.einsum("cihn,chpn->cihp", _per_head(C[tokens], num_heads), before) * jnp.exp(cum)[..., None]

    y = _in_groups(from_before, group or tokens.shape[0], y, before, tokens, layout.mask)
    place = scatter_index(layout.tokens.reshape(-1), layout.mask.reshape(-1), num_tokens)
    out = jnp.zeros(x.shape, jnp.float32).at[place].set(y.reshape(-1, *x.shape[1:]), mode="drop", unique_indices=True)
    return out, states[layout.last]


def ssd_update(x, dt, A, B, C, states):
    """One token per request: x [R, H, P], dt [R, H], A [H], B, C [R, G, N], states [R, H, P, N]
    (float32) -> (y [R, H, P], new states [R, H, P, N])."""
    num_heads = dt.shape[1]
    decay = jnp.exp(dt * A)                                            # [R, H]
    b, c = _per_head(B, num_heads), _per_head(C, num_heads)            # [R, H, N]
    dtx = dt[..., None] * x                                            # [R, H, P]
    # y = C . (the new state), as decay (C . state) + dt x (C . B): y reads the old state, so the new
    # one is made only where it is stored (the caller's scatter), never kept whole in float32; and
    # a multiply-and-sum, not an einsum, which a GPU would run as a batched matmul, apart from the
    # gather of the states that feeds it. (Mamba2-2.7B's 256 requests: a layer's float32 states
    # are 0.67 GB, each pass over them a quarter of a millisecond on an H100.)
    y = decay[..., None] * jnp.sum(states * c[:, :, None, :], axis=-1) + dtx * jnp.sum(b * c, axis=-1)[..., None]
    return y, decay[..., None, None] * states + dtx[..., None] * b[:, :, None, :]


def _pallas_chosen(variable: str) -> bool:
    """Whether the environment variable picks the Pallas kernel ("pallas") over plain JAX ("reference", unset)."""
    choice = os.environ.get(variable, "reference")
    if choice not in ("reference", "pallas"):
        raise ValueError(f"{variable} must be 'reference' or 'pallas', got {choice!r}")
    return choice == "pallas"


def chunk_terms_fn():
    """The chunk terms' implementation a model runs: with JAXLLM_SSD_KERNEL=pallas the Pallas kernel
    (kernels/pallas_ssd.py; in the interpreter off a GPU), else ("reference", the default until the
    kernel is measured on a GPU) chunk_terms."""
    if not _pallas_chosen("JAXLLM_SSD_KERNEL"):
        return chunk_terms
    from jaxllm.kernels import pallas_ssd
    return functools.partial(pallas_ssd.chunk_terms, interpret=jax.default_backend() != "gpu")


def state_update_fn():
    """The decode steps' state update a model runs: with JAXLLM_SSD_UPDATE=pallas the Pallas kernel that
    updates the cache in place (kernels/pallas_ssd.py; in the interpreter off a GPU), else None
    ("reference", the default until the kernel is measured on a GPU): ssd_update between a gather and
    a scatter of the requests' slots."""
    if not _pallas_chosen("JAXLLM_SSD_UPDATE"):
        return None
    from jaxllm.kernels import pallas_ssd
    return functools.partial(pallas_ssd.state_update, interpret=jax.default_backend() != "gpu")


def ragged_ssd(x, dt, A, B, C, initial_states, query_start_loc, num_seqs, chunk_size: int, terms=chunk_terms):
    """Every request's SSM over its tokens of the step: the chunk scan for requests of two tokens
    or more, the update for those of one.

    x [T, H, P], dt [T, H] (after softplus), A [H], B, C [T, G, N], initial_states [R, H, P, N]
    (zeros for a request without a state yet): float32; query_start_loc [R + 1], num_seqs [1] int32;
    terms: the chunk terms' implementation (chunk_terms_fn).
    Returns (y [T, H, P] float32, without the D skip; the requests' states after their tokens [R, H,
    P, N], a padding request's its initial state)."""
    num_reqs = initial_states.shape[0]
    slots = jnp.arange(num_reqs, dtype=jnp.int32)
    write_slots = jnp.where(slots < jnp.reshape(num_seqs, ()), slots, num_reqs)  # padding's writes dropped
    return ragged_ssd_in_slots(x, dt, A, B, C, initial_states, slots, jnp.ones(num_reqs, bool), write_slots,
                               query_start_loc, num_seqs, chunk_size, terms)


def ragged_ssd_in_slots(x, dt, A, B, C, states, slots, has_state, write_slots, query_start_loc, num_seqs,
                        chunk_size: int, terms=chunk_terms, decodes_only: bool = False, update=None):
    """ragged_ssd over a cache of states [S, H, P, N] (any float dtype; math in float32): request i
    starts from states[slots[i]] (zeros where not has_state[i]) and ends in states[write_slots[i]]
    (out of range: dropped). Returns (y [T, H, P] float32, the cache with the step's states written).
    decodes_only: the caller knows every request has at most one token: the update alone runs, with
    no conditional around the chunk scan (on a GPU, XLA's conditional waits on the host for its
    branch index: a device-to-host round trip per layer and step). update: with decodes_only, the
    in-place state update that takes the plain one's place (state_update_fn).

    Only the step's requests' slots are read and written: one gather of their rows feeds the update
    (ssd_update, its new states scattered into their slots) and the chunk scan's branch (which a
    decode step does not run). At Mamba2-2.7B's 256 requests a layer's
    states are 0.33 GB in bfloat16, so each extra pass over them costs about 0.13 ms per layer at
    an H100's 2.5 TB/s, 8.5 ms a step over its 64 layers."""
    num_tokens, num_reqs, num_slots = x.shape[0], slots.shape[0], states.shape[0]
    real = jnp.arange(num_reqs) < jnp.reshape(num_seqs, ())
    query_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    first = jnp.minimum(query_start_loc[:-1], num_tokens - 1)
    one = query_lens == 1
    if decodes_only and update is not None:
        y_one, states = update(x[first], dt[first], A, B[first], C[first], states, slots, has_state,
                               jnp.where(one, write_slots, num_slots))
        return jnp.zeros(x.shape, jnp.float32).at[scatter_index(first, one, num_tokens)].set(
            y_one, mode="drop", unique_indices=True), states
    chunk = min(chunk_size, num_tokens)

    # The cache is read once, its requests' slots, before it is written: where two reads feed the
    # outputs and the writes, XLA copies the whole cache so that a write cannot come first.
    start = jnp.where(has_state[:, None, None, None], states[slots].astype(jnp.float32), 0.0)

    # The chunk scan runs over as many chunk slots as it needs, of a few sizes: none without a prefill
    # request (a decode step), the bucket's full chunks and a few partial ones (a step of a few prefill
    # requests: the usual mix), or the bucket's most (every request a short prefill). Its work grows
    # with its slots: the bucket's most cost a decode step many times the update's. Its memory does
    # not: the terms are made a usual step's chunks at a time.
    usual, most = usual_chunks(num_tokens, num_reqs, chunk), max_chunks(num_tokens, num_reqs, chunk)
    sizes = sorted({usual, most})
    needed = jnp.sum(jnp.where(query_lens >= 2, (query_lens + chunk - 1) // chunk, 0))

    def scan(num_chunks: int):
        layout = functools.partial(chunk_layout, query_lens, query_start_loc, num_tokens, chunk, num_chunks)

        def run():
            y, final = ssd_chunk_scan(x, dt, A, B, C, start, layout(), terms, usual)
            return y, final.astype(states.dtype)
        return run
    if decodes_only:
        y = jnp.zeros(x.shape, jnp.float32)
    else:
        none = (jnp.zeros(x.shape, jnp.float32), jnp.zeros((num_reqs, *states.shape[1:]), states.dtype))
        which = jnp.where(needed == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes, jnp.int32), needed))
        y, prefill_states = jax.lax.switch(which, [lambda: none] + [scan(n) for n in sizes])  # (one branch runs)
    y_one, one_states = ssd_update(x[first], dt[first], A, B[first], C[first], start)
    y = y.at[scatter_index(first, one, num_tokens)].set(y_one, mode="drop", unique_indices=True)
    states = states.at[scatter_index(write_slots, one, num_slots)].set(one_states.astype(states.dtype), mode="drop",
                                                                      unique_indices=True)
    if not decodes_only:
        states = states.at[scatter_index(write_slots, query_lens >= 2, num_slots)].set(
            prefill_states, mode="drop", unique_indices=True)
    return y, states
