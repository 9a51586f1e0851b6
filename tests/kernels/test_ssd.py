"""Mamba2's SSD scan and state update (kernels/ssd.py) against the naive recurrence in float64,
over ragged batches of prefill chunks (with and without a state to continue from) and decodes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import pallas_ssd
from jaxllm.kernels.ssd import (chunk_terms, chunk_terms_fn, ragged_ssd, ragged_ssd_in_slots, scan_bytes, ssd_update,
                                state_update_fn, windows)

H, P, G, N = 4, 3, 2, 5  # heads, head_dim, groups, state_size


def naive_ssd(x, dt, A, B, C, states, query_lens):
    """Token by token in float64: S = exp(dt A) S + dt x B^T, y = S C; per request from its state."""
    x, dt, A, B, C, states = (np.asarray(a, np.float64) for a in (x, dt, A, B, C, states))
    y, final, start = np.zeros_like(x), states.copy(), 0
    heads_per_group = H // G
    for r, length in enumerate(query_lens):
        s = states[r].copy()
        for t in range(start, start + length):
            for h in range(H):
                g = h // heads_per_group
                s[h] = np.exp(dt[t, h] * A[h]) * s[h] + dt[t, h] * np.outer(x[t, h], B[t, g])
                y[t, h] = s[h] @ C[t, g]
        final[r] = s
        start += length
    return y, final


def random_batch(num_tokens, num_reqs, with_state, seed=0):
    """Random inputs of ragged_ssd for num_tokens tokens and num_reqs requests, those not with_state
    starting from zeros."""
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (num_tokens, H, P))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (num_tokens, H)) - 1.0)
    A = -jnp.exp(jax.random.normal(keys[2], (H,)) * 0.5)
    B = jax.random.normal(keys[3], (num_tokens, G, N))
    C = jax.random.normal(keys[4], (num_tokens, G, N))
    states = jax.random.normal(keys[5], (num_reqs, H, P, N)) * np.asarray(with_state, np.float32)[:, None, None, None]
    return x, dt, A, B, C, states


NUM_TOKENS, NUM_REQS = 32, 8  # every batch padded to these: one compilation per chunk size
ssd = jax.jit(ragged_ssd, static_argnums=(8, 9))
PALLAS = functools.partial(pallas_ssd.chunk_terms, interpret=True)


def run_ssd(x, dt, A, B, C, states, query_lens, chunk_size, terms=chunk_terms):
    """ragged_ssd over `query_lens` (the first len(query_lens) requests), its inputs padded."""
    qsl = np.zeros(NUM_REQS + 1, np.int32)
    qsl[1:len(query_lens) + 1] = np.cumsum(query_lens)
    qsl[len(query_lens) + 1:] = qsl[len(query_lens)]  # padding requests repeat the last offset
    pad = ((0, NUM_TOKENS - x.shape[0]),)
    x, dt, B, C = (jnp.pad(a, pad + ((0, 0),) * (a.ndim - 1)) for a in (x, dt, B, C))
    states = jnp.pad(states, ((0, NUM_REQS - states.shape[0]), (0, 0), (0, 0), (0, 0)))
    return ssd(x, dt, A, B, C, states, jnp.asarray(qsl), jnp.array([len(query_lens)], jnp.int32), chunk_size, terms)


@pytest.mark.parametrize("terms", [chunk_terms, PALLAS], ids=["reference", "pallas"])
@pytest.mark.parametrize("query_lens, chunk_size", [
    ([1], 4), ([1, 1, 1], 4),          # decodes alone: no token in the chunk scan
    ([2] * 7 + [1], 8),                # several requests inside one window, each ending mid-window
    ([2] * 5 + [3], 16),
    ([4], 4), ([5], 4), ([9], 4),      # a prefill at, past and across window boundaries
    ([3, 1, 7, 1, 1, 6], 4),           # decodes between prefill chunks, beside them in a window
    ([17, 2, 1], 8),                   # a long chunk, a two-token one, a decode
    ([13, 11], 64),                    # windows longer than the batch: one window
    ([3, 10, 2, 9], 8),                # requests that start mid-window and go on into the next
    ([6, 1, 5, 12, 2], 8),             # a one-token request between prefill chunks in one window
    ([31], 8), ([7, 25], 8),           # up to the bucket's last token
])
def test_ragged_ssd_matches_the_naive_recurrence(query_lens, chunk_size, terms):
    num_reqs = len(query_lens)
    with_state = [i % 2 == 1 or q == 1 for i, q in enumerate(query_lens)]
    x, dt, A, B, C, states = random_batch(sum(query_lens), num_reqs, with_state)
    y, final = run_ssd(x, dt, A, B, C, states, query_lens, chunk_size, terms)
    want_y, want_final = naive_ssd(x, dt, A, B, C, states, query_lens)
    np.testing.assert_allclose(y[:sum(query_lens)], want_y, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(final[:num_reqs], want_final, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(final[num_reqs:], 0)  # padding requests keep their (zero) states


def test_a_prefill_split_into_chunks_continues_from_each_chunks_state():
    """One request's 23 tokens in steps of 7, 1, 9, 6: each step starts from the state the last left."""
    num_tokens = 23
    x, dt, A, B, C, states = random_batch(num_tokens, 1, [0])
    want_y, want_final = naive_ssd(x, dt, A, B, C, states, [num_tokens])
    state, start = states, 0
    for n in (7, 1, 9, 6):
        part = slice(start, start + n)
        y, state = run_ssd(x[part], dt[part], A, B[part], C[part], state, [n], 4)
        state = state[:1]
        np.testing.assert_allclose(y[:n], want_y[part], rtol=2e-4, atol=2e-4)
        start += n
    np.testing.assert_allclose(state, want_final, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("query_lens, decodes_only, update", [
    ([3, 1, 7, 1], False, None), ([1, 1, 1, 1], False, None), ([1, 1, 1, 1], True, None),
    ([1, 1, 1, 1], True, functools.partial(pallas_ssd.state_update, interpret=True)),
], ids=["mixed", "decodes", "decodes-only", "decodes-only, the pallas update"])
def test_in_slots_a_step_reads_and_writes_its_requests_slots_alone(query_lens, decodes_only, update):
    """A bfloat16 cache of more slots than requests, in no order: each request starts from its slot
    (zeros without a state: its slot's contents unread), ends in it, and every other slot (NaN: a
    read of one would show) is left as it was; against the naive recurrence from the same states.
    decodes_only: the update alone, with no chunk scan, as a step the host knows to be all decodes;
    update: the in-place kernel in its place."""
    slots, has_state = [5, 2, 7, 0], [True, True, False, True]
    x, dt, A, B, C, _ = random_batch(sum(query_lens), NUM_REQS, [1] * NUM_REQS)
    cache = jnp.full((9, H, P, N), jnp.nan, jnp.bfloat16)
    cache = cache.at[jnp.array(slots)].set(jax.random.normal(jax.random.key(1), (4, H, P, N)).astype(jnp.bfloat16))
    padded_slots = np.array(slots + [1] * (NUM_REQS - 4), np.int32)  # padding reads a NaN slot, writes nothing
    qsl = np.concatenate([[0], np.cumsum(query_lens), [sum(query_lens)] * (NUM_REQS - 4)]).astype(np.int32)
    pad = ((0, NUM_TOKENS - x.shape[0]),)
    x, dt, B, C = (jnp.pad(a, pad + ((0, 0),) * (a.ndim - 1)) for a in (x, dt, B, C))
    in_slots = jax.jit(functools.partial(ragged_ssd_in_slots, decodes_only=decodes_only, update=update),
                       static_argnums=(11,))
    y, after = in_slots(x, dt, A, B, C, cache, padded_slots, np.array(has_state + [False] * (NUM_REQS - 4)),
                        np.where(np.arange(NUM_REQS) < 4, padded_slots, cache.shape[0]), qsl, np.array([4], np.int32), 4)
    initial = jnp.where(jnp.array(has_state)[:, None, None, None], cache[jnp.array(slots)].astype(jnp.float32), 0.0)
    real = slice(0, sum(query_lens))
    want_y, want_final = naive_ssd(x[real], dt[real], A, B[real], C[real], initial, query_lens)
    np.testing.assert_allclose(y[real], want_y, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(after[jnp.array(slots)].astype(jnp.float32), want_final, rtol=2e-2, atol=2e-2)
    others = np.setdiff1d(np.arange(cache.shape[0]), slots)
    assert np.isnan(np.asarray(after[others], np.float32)).all()


@pytest.mark.parametrize("num_tokens, num_reqs, heads, head_dim, state_size, chunk_size", [
    (256, 32, 8, 16, 16, 16), (1024, 64, 16, 32, 64, 64),
    (512, 128, 80, 64, 128, 256),  # Mamba2-2.7B's SSM: many short prefills, in groups
])
def test_the_budgets_scan_bound_holds_what_xla_keeps_for_the_scan(num_tokens, num_reqs, heads, head_dim, state_size,
                                                                   chunk_size):
    """The KV cache's budget reserves scan_bytes for a Mamba layer: it must cover the compiled scan's
    temporaries (XLA's memory analysis) without reserving much more."""
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = (f32((num_tokens, heads, head_dim)), f32((num_tokens, heads)), f32((heads,)),
            f32((num_tokens, 1, state_size)), f32((num_tokens, 1, state_size)),
            f32((num_reqs, heads, head_dim, state_size)), jax.ShapeDtypeStruct((num_reqs + 1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    scan = jax.jit(functools.partial(ragged_ssd, chunk_size=chunk_size)).lower(*args).compile()
    kept = scan.memory_analysis().temp_size_in_bytes
    assert kept <= scan_bytes(num_tokens, num_reqs, chunk_size, heads, head_dim, state_size) <= 1.5 * kept


def test_windows_mark_each_prefill_token_with_its_request_and_no_decode_or_padding():
    query_lens = jnp.array([5, 1, 2, 0], jnp.int32)
    qsl = jnp.array([0, 5, 6, 8, 8], jnp.int32)
    lay = windows(qsl, query_lens, 9, 4)  # 9 tokens: 3 windows, the last 3 tokens padding
    assert np.asarray(lay.segment).tolist() == [[0, 0, 0, 0], [0, -1, 2, 2], [-1, -1, -1, -1]]
    assert np.asarray(lay.request)[:8].tolist() == [0, 0, 0, 0, 0, 1, 2, 2]


def test_the_pallas_chunk_terms_equal_the_plain_jax_ones_at_a_kernel_sized_shape():
    """Tiles as Triton takes them (Q, P, N powers of two), four heads reading two groups."""
    keys = jax.random.split(jax.random.key(1), 5)
    c, q, h, p, g, n = 3, 16, 4, 16, 2, 16
    xc = jax.random.normal(keys[0], (c, q, h, p))
    dtc = jax.nn.softplus(jax.random.normal(keys[1], (c, q, h)) - 1.0).at[-1, q // 2:].set(0.0)  # a padded tail
    cum = jnp.cumsum(dtc * -jnp.exp(jax.random.normal(keys[2], (h,))), axis=1)
    bc, cc = jax.random.normal(keys[3], (c, q, g, n)), jax.random.normal(keys[4], (c, q, g, n))
    # a window of one request, one of three (the last going on), one of a request's end and padding
    segment = jnp.array([[0] * q, [1] * 5 + [2] * 4 + [3] * (q - 9), [3] * 6 + [-1] * (q - 6)], jnp.int32)
    want, got = chunk_terms(xc, dtc, cum, bc, cc, segment), PALLAS(xc, dtc, cum, bc, cc, segment)
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variable, choose, default, kernel", [
    ("JAXLLM_SSD_KERNEL", chunk_terms_fn, chunk_terms, pallas_ssd.chunk_terms),
    ("JAXLLM_SSD_UPDATE", state_update_fn, None, pallas_ssd.state_update)])
def test_the_models_ssd_kernels_follow_the_environment(monkeypatch, variable, choose, default, kernel):
    assert choose() is default
    monkeypatch.setenv(variable, "pallas")
    assert choose().func is kernel
    monkeypatch.setenv(variable, "triton")
    with pytest.raises(ValueError, match=f"{variable} must be 'reference' or 'pallas', got 'triton'"):
        choose()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("chunk", [64, 128])
def test_the_compiled_pallas_chunk_terms_equal_the_plain_jax_ones_at_mamba2s_shape(chunk):
    """Mamba2-2.7B's heads (head_dim 64, state 128, one group), 4 chunks, through Triton, against plain
    JAX in full float32 (XLA's default f32 matmuls on an H100 are TF32: 0.3% off). A chunk of 256 asks
    for 448 KiB of shared memory, past the 227 KiB a Hopper program has."""
    keys = jax.random.split(jax.random.key(2), 5)
    c, h, p, g, n = 4, 8, 64, 1, 128
    xc = jax.random.normal(keys[0], (c, chunk, h, p))
    dtc = jax.nn.softplus(jax.random.normal(keys[1], (c, chunk, h)) - 2.0)
    cum = jnp.cumsum(dtc * -jnp.exp(jax.random.normal(keys[2], (h,))), axis=1)
    bc, cc = jax.random.normal(keys[3], (c, chunk, g, n)), jax.random.normal(keys[4], (c, chunk, g, n))
    segment = jnp.repeat(jnp.arange(2 * c, dtype=jnp.int32).reshape(c, 2), chunk // 2, axis=1)  # two requests a window
    with jax.default_matmul_precision("highest"):
        want = jax.jit(chunk_terms)(xc, dtc, cum, bc, cc, segment)
    got = pallas_ssd.chunk_terms(xc, dtc, cum, bc, cc, segment)
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=2e-3, atol=2e-3)


def update_case(num_reqs, heads, head_dim, groups, state_size, num_slots, real, dtype=jnp.bfloat16):
    """A decode step's update inputs: the first `real` requests in distinct slots (the second without
    a state), the rest padding; every other slot NaN, so that a read of one shows."""
    keys = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(keys[0], (num_reqs, heads, head_dim))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (num_reqs, heads)) - 1.0)
    A = -jnp.exp(jax.random.normal(keys[2], (heads,)))
    B, C = (jax.random.normal(k, (num_reqs, groups, state_size)) for k in keys[3:5])
    slots = np.concatenate([np.random.default_rng(0).permutation(num_slots)[:real], np.zeros(num_reqs - real)])
    slots = slots.astype(np.int32)
    has_state = np.arange(num_reqs) != 1
    cache = jnp.full((num_slots, heads, head_dim, state_size), jnp.nan, dtype)
    cache = cache.at[slots[:real]].set(jax.random.normal(keys[5], (real, heads, head_dim, state_size)).astype(dtype))
    write_slots = np.where(np.arange(num_reqs) < real, slots, num_slots).astype(np.int32)
    return (x, dt, A, B, C, cache, slots, has_state, write_slots), slots[:real]


def assert_update_in_place_is_ssd_update(args, used, interpret, tol):
    x, dt, A, B, C, cache, slots, has_state, write_slots = args
    real = len(used)
    initial = jnp.where(jnp.asarray(has_state)[:, None, None, None], cache[slots].astype(jnp.float32), 0.0)
    want_y, want_states = ssd_update(x, dt, A, B, C, initial)
    y, after = pallas_ssd.state_update(*args[:5], cache.copy(), slots, has_state, write_slots, interpret=interpret)
    np.testing.assert_allclose(y[:real], want_y[:real], rtol=tol, atol=tol)
    assert not np.asarray(y[real:]).any()  # padding: zeros
    np.testing.assert_allclose(after[used].astype(jnp.float32), want_states[:real].astype(after.dtype).astype(jnp.float32),
                               rtol=1e-2, atol=1e-2)
    others = np.setdiff1d(np.arange(cache.shape[0]), used)
    assert np.isnan(np.asarray(after[others], np.float32)).all()  # untouched


def test_the_pallas_state_update_writes_the_requests_slots_in_place_as_the_plain_update():
    args, used = update_case(num_reqs=6, heads=4, head_dim=8, groups=2, state_size=16, num_slots=9, real=4)
    assert_update_in_place_is_ssd_update(args, used, interpret=True, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_the_compiled_pallas_state_update_equals_the_plain_one_at_mamba2s_shape():
    """Mamba2-2.7B's heads (80 of head_dim 64, state 128, one group), a bucket of 16 with 3 real requests."""
    args, used = update_case(num_reqs=16, heads=80, head_dim=64, groups=1, state_size=128, num_slots=256, real=3)
    assert_update_in_place_is_ssd_update(args, used, interpret=False, tol=1e-4)
