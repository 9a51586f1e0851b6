"""Mamba2's selective state space over the engine's ragged batch, in plain JAX: the chunked SSD
scan (state-space duality) for prefill chunks, the one-step update for decodes.

Per head h of a request, with a_t = dt_t * A_h (A < 0) and a state S_t [head_dim, state_size]:
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t
from the request's state S_0 (zeros on its first step; the skip D x_t is the caller's).

The scan cuts the step's token axis into W = cdiv(T, Q) windows of Q, whatever the requests: a
window may hold the end of one request, whole ones and the start of the next, so one program serves
every mix of a bucket (no branch on the device, whose index a GPU reads on the host). With cum the
running sum of a within a window, and tokens of two requests never meeting, each window gives
    within:   y_i  = sum_{j <= i, same request} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j
    its own:  U_w  = sum_{j of its last token's request} exp(cum_last - cum_j) dt_j x_j B_j^T
    between:  S_w  = exp(cum_last) S_{w-1} + U_w,   y_i += exp(cum_i) S_{w-1} C_i  (i's request
              begun before window w)
the window-to-window recurrence an associative scan, restarted where the last token's request
begins in the window (from its S_0). Per request, two [Q] gathers: its first window's tokens, which
read S_0 (decayed from the request's start), and its last window's, whose sum with S_{w-1} (or S_0)
is its final state, taken at its last token, mid-window or not. A request of one token (a decode,
or a one-token prefill chunk) takes the update instead; its tokens add nothing to the windows.

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


class Windows(NamedTuple):
    """The step's tokens in W = cdiv(T, Q) windows of Q on the token axis (the last one padded): a
    window may hold the end of one request, whole requests and the start of another."""
    request: jax.Array   # [W * Q] int32: each token's request (a padding token: the last request)
    prefill: jax.Array   # [W * Q] bool: a token of a request of two tokens or more (the scan's)
    segment: jax.Array   # [W, Q] int32: the token's request where prefill, else -1
    starts: jax.Array    # [R] int32: each request's first token


def windows(query_start_loc, query_lens, num_tokens: int, chunk_size: int) -> Windows:
    """Where the requests of query_lens [R] int32 (0 for padding) lie in windows of chunk_size."""
    num_reqs, padded = query_lens.shape[0], cdiv(num_tokens, chunk_size) * chunk_size
    token = jnp.arange(padded, dtype=jnp.int32)
    # query_start_loc [0, 3, 3, 5] -> tokens [0, 1, 2, 3, 4] are requests [0, 0, 0, 2, 2]
    request = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right", method="compare_all"),
                          num_reqs - 1).astype(jnp.int32)
    starts = query_start_loc[:-1]
    prefill = (token < starts[request] + query_lens[request]) & (query_lens[request] >= 2)
    return Windows(request, prefill, jnp.where(prefill, request, -1).reshape(-1, chunk_size), starts)


MAX_WINDOW = 64  # window_size


def window_size(chunk_size: int, num_tokens: int) -> int:
    """The scan's window Q: the model's chunk size, at most MAX_WINDOW tokens and the bucket's. Any Q gives
    the same outputs (up to rounding); the two per-request gathers cost R x Q x H x P x N each whatever the
    step's mix, so Mamba2-2.7B's chunks of 256 at 256 requests would spend ~170 GFLOP a layer on them; at
    64, a step of three prompts beside 253 decodes over 2,048 tokens ran in 5.4 s a layer on this CPU
    against 17 s at 256 (3.6 s before the windows, with their branches)."""
    return min(chunk_size, MAX_WINDOW, num_tokens)


def scan_bytes(num_tokens: int, num_reqs: int, chunk_size: int, num_heads: int, head_dim: int,
               state_size: int) -> int:
    """A bound on ragged_ssd's transient memory at a bucket of num_tokens tokens and num_reqs requests
    (fp32): a few [R, Q, H, P] gathers of each request's first and last window's tokens and [R, H, P, N]
    states, the windows' [W, Q, Q, H] products and [W, H, P, N] states, a few [T, H, P] outputs. Within
    1.06-1.33x of what XLA's memory analysis reports, from tiny shapes to Mamba2-2.7B's at 8192 tokens."""
    q = window_size(chunk_size, num_tokens)
    padded = cdiv(num_tokens, q) * q
    return 4 * (3 * num_reqs * q * num_heads * head_dim + 2 * num_reqs * num_heads * head_dim * state_size
                + padded * q * num_heads + 3 * padded // q * num_heads * head_dim * state_size
                + 4 * padded * num_heads * head_dim)


def _per_head(bc, num_heads: int):
    """B or C [..., groups, state_size] -> [..., num_heads, state_size]: head h reads group h // (heads / groups)."""
    return jnp.repeat(bc, num_heads // bc.shape[-2], axis=-2)


def _by_group(a, groups: int, axis: int):
    """a's heads axis [H] split into [groups, H / groups] (head h in group h // (H / groups)): an einsum
    then reads B or C [..., groups, N] per group, with no [..., H, N] copy of them."""
    return a.reshape(*a.shape[:axis], groups, -1, *a.shape[axis + 1:])


def chunk_terms(xc, dtc, cum, bc, cc, segment):
    """The two terms each window makes alone, in plain JAX: xc [c, Q, H, P], dtc and cum [c, Q, H], bc
    and cc [c, Q, G, N] (per group), float32, segment [c, Q] int32 (each token's request: tokens of
    two requests never meet) -> (y within the window [c, Q, H, P], U_c [c, H, P, N]: what the
    window's last token's request adds to its state in the window). kernels/pallas_ssd.py computes the
    same in one Pallas kernel."""
    num_heads = dtc.shape[2]
    bc, cc = _per_head(bc, num_heads), _per_head(cc, num_heads)     # [c, Q, H, N]
    q = xc.shape[1]
    causal = jnp.arange(q)[:, None] >= jnp.arange(q)[None, :]
    same = (causal & (segment[:, :, None] == segment[:, None, :]))[..., None]  # [c, i, j, 1]
    decay = jnp.exp(jnp.where(same, cum[:, :, None, :] - cum[:, None, :, :], -jnp.inf))  # [c, i, j, H]
    scores = jnp.einsum("cihn,cjhn->cijh", cc, bc) * decay
    y = jnp.einsum("cijh,cjh,cjhp->cihp", scores, dtc, xc)
    to_end = jnp.where((segment == segment[:, -1:])[..., None], jnp.exp(cum[:, -1:] - cum) * dtc, 0.0)  # [c, Q, H]
    return y, jnp.einsum("cjh,cjhn,cjhp->chpn", to_end, bc, xc)


def ssd_chunk_scan(x, dt, A, B, C, initial_states, query_start_loc, query_lens, chunk_size: int,
                   terms=chunk_terms):
    """The outputs and final states of the requests of two tokens or more (the module's docstring).

    x [T, H, P], dt [T, H] (after softplus), A [H], B, C [T, G, N], initial_states [R, H, P, N]: all
    float32; query_start_loc [R + 1], query_lens [R] int32 (0 for padding); chunk_size: Q, at most T;
    terms: chunk_terms or its Pallas kernel. Returns (y [T, H, P]: zeros outside those requests,
    final states [R, H, P, N]: those requests', the others' not meaningful)."""
    num_tokens, num_heads = dt.shape
    groups, q = B.shape[1], chunk_size
    lay = windows(query_start_loc, query_lens, num_tokens, q)
    num_windows, padded = lay.segment.shape[0], lay.segment.size
    prefill = lay.prefill[:num_tokens, None]
    pad = lambda a: jnp.pad(a, [(0, padded - num_tokens)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    dt, x, B, C = pad(jnp.where(prefill, dt, 0.0)), pad(jnp.where(prefill[..., None], x, 0.0)), pad(B), pad(C)
    in_windows = lambda a: a.reshape(num_windows, q, *a.shape[1:])  # noqa: E731
    cum = jnp.cumsum(in_windows(dt) * A, axis=1)                      # [W, Q, H]: other tokens add 0
    y, own = terms(in_windows(x), in_windows(dt), cum, in_windows(B), in_windows(C), lay.segment)
    cum = cum.reshape(padded, num_heads)
    window_start = lambda t: t - t % q  # noqa: E731

    def since(start, t):
        """The decay [..., H] from token `start` of a request (before it) to token t, in t's window."""
        before = jnp.where((start % q == 0)[..., None], 0.0, cum[jnp.maximum(start - 1, 0)])
        return cum[t] - jnp.where((start < window_start(t))[..., None], 0.0, before)

    # S_w, the state of window w's last token's request at the window's end (what a request that goes
    # on into the next window starts it from): S_w = g_w S_{w-1} + b_w, restarted (g = 0) where that
    # request begins in window w, its initial state folded into b.
    last = jnp.arange(num_windows) * q + q - 1
    last_req = lay.request[last]
    continues = lay.starts[last_req] < last - (q - 1)
    gates = jnp.where(continues[:, None], jnp.exp(cum[last]), 0.0)[..., None, None]
    begins = jnp.where((continues | ~lay.prefill[last])[:, None], 0.0, jnp.exp(since(lay.starts[last_req], last)))
    adds = own + begins[..., None, None] * initial_states[last_req]

    def combine(earlier, later):
        return earlier[0] * later[0], later[0] * earlier[1] + later[1]

    _, states = jax.lax.associative_scan(combine, (gates, adds))     # [W, H, P, N]
    before = jnp.concatenate([jnp.zeros_like(states[:1]), states[:-1]])  # S_{w-1}

    # A token whose request began in an earlier window reads S_{w-1}; one in its request's first
    # window reads the request's initial state (below).
    token = jnp.arange(padded)
    carried = lay.prefill & (lay.starts[lay.request] < window_start(token))
    from_before = jnp.einsum("wign,wgepn->wigep", in_windows(C), _by_group(before, groups, 1))
    y = y.reshape(padded, num_heads, -1) + jnp.where(carried[:, None, None], jnp.exp(cum)[..., None], 0.0) \
        * from_before.reshape(padded, num_heads, -1)

    # Per request, its first window's tokens (from its first) and its last window's (back from its
    # last): [R, Q] each, tokens of other windows or requests masked.
    lens = jnp.where(query_lens >= 2, query_lens, 0)
    ends = lay.starts + lens - 1
    k = jnp.arange(q)
    first = lay.starts[:, None] + k                                   # [R, Q]
    in_first = (k < jnp.minimum(lens, q - lay.starts % q)[:, None])
    first = jnp.where(in_first, first, 0)
    y_start = jnp.einsum("rkgn,rgepn->rkgep", C[first], _by_group(initial_states, groups, 1)).reshape(
        *first.shape, num_heads, -1) * jnp.exp(since(lay.starts[:, None], first))[..., None]
    place = scatter_index(jnp.where(in_first, first, 0).reshape(-1), in_first.reshape(-1), padded)
    y = y.at[place].add(y_start.reshape(-1, *y.shape[1:]), mode="drop", unique_indices=True)

    tail = ends[:, None] - k                                          # [R, Q]
    in_tail = tail >= jnp.maximum(lay.starts, window_start(ends))[:, None]
    tail = jnp.where(in_tail, tail, 0)
    to_end = jnp.where(in_tail[..., None], jnp.exp(cum[ends][:, None] - cum[tail]) * dt[tail], 0.0)  # [R, Q, H]
    own_tail = jnp.einsum("rkge,rkgn,rkgep->rgepn", _by_group(to_end, groups, 2), B[tail],
                          _by_group(x[tail], groups, 2)).reshape(initial_states.shape)
    continued = lay.starts < window_start(ends)
    entry = jnp.where(continued[:, None, None, None], before[ends // q], initial_states)
    final = jnp.exp(since(lay.starts, ends))[..., None, None] * entry + own_tail
    return y[:num_tokens], jnp.where((lens > 0)[:, None, None, None], final, 0.0)


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
    chunk_size: the model's, the scan's windows window_size(chunk_size, T);
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
    decodes_only: the caller knows every request has at most one token: the update alone runs, not the
    chunk scan over the bucket's windows. update: with decodes_only, the
    in-place state update that takes the plain one's place (state_update_fn).

    Only the step's requests' slots are read and written: one gather of their rows feeds the update
    (ssd_update, its new states scattered into their slots) and the chunk scan (which a decodes-only
    step does not run). At Mamba2-2.7B's 256 requests a layer's
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
    chunk = window_size(chunk_size, num_tokens)

    # The cache is read once, its requests' slots, before it is written: where two reads feed the
    # outputs and the writes, XLA copies the whole cache so that a write cannot come first.
    start = jnp.where(has_state[:, None, None, None], states[slots].astype(jnp.float32), 0.0)

    y_one, new_states = ssd_update(x[first], dt[first], A, B[first], C[first], start)
    if decodes_only:
        y = jnp.zeros(x.shape, jnp.float32)
    else:
        y, prefill_states = ssd_chunk_scan(x, dt, A, B, C, start, query_start_loc, query_lens, chunk, terms)
        new_states = jnp.where(one[:, None, None, None], new_states, prefill_states)
    y = y.at[scatter_index(first, one, num_tokens)].set(y_one, mode="drop", unique_indices=True)
    return y, states.at[scatter_index(write_slots, query_lens >= 1, num_slots)].set(
        new_states.astype(states.dtype), mode="drop", unique_indices=True)
