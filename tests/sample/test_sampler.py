"""The on-device sampler against its definition."""
import jax.numpy as jnp
import numpy as np
import pytest

import jax

from jaxllm.sample import sampler

sample = jax.jit(sampler.sample)
SamplingMetadata = sampler.SamplingMetadata


def metadata(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None):
    full = lambda v, dt: jnp.full((n,), v, dt)
    return SamplingMetadata(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                            full(min_p, jnp.float32),
                            seed_words(np.arange(n) if seeds is None else seeds),
                            jnp.zeros(n, jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32))


def seed_words(seeds):
    seeds = np.asarray(seeds, np.uint64)
    return jnp.asarray(np.stack([seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)], -1).astype(np.uint32))


def random_logits(n, vocab=64, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, vocab)) * 3, jnp.float32)


def test_temperature_zero_is_argmax():
    logits = random_logits(8)
    tokens = sample(logits, metadata(8, temperature=0.0))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))


def sampled_tokens(probs, num_draws=200, **filters) -> set[int]:
    """The tokens that one request draws from `probs` over `num_draws` positions."""
    logits = jnp.log(jnp.asarray([probs], jnp.float32))
    return {int(sample(logits, metadata(1, positions=[p], **filters))[0]) for p in range(num_draws)}


def test_top_k_keeps_exactly_k_tokens():
    assert sampled_tokens([0.3, 0.25, 0.2, 0.15, 0.1], top_k=3) == {0, 1, 2}


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_minus_one_and_zero_keep_every_token(top_k):
    # top_p < 1: the filter, which reads top_k, runs whatever shortcut the sampler takes without one.
    assert sampled_tokens([0.3, 0.25, 0.2, 0.15, 0.1], top_k=top_k, top_p=0.99) == {0, 1, 2, 3, 4}


def test_top_p_stops_at_the_token_whose_mass_before_reaches_it():
    # Powers of two, exact in float32: the mass before token 2 is 0.75 = top_p, so it goes (as in vLLM).
    assert sampled_tokens([0.5, 0.25, 0.125, 0.125], top_p=0.75) == {0, 1}


def test_min_p_keeps_a_token_at_exactly_min_p_times_the_top_probability():
    assert sampled_tokens([0.5, 0.25, 0.125, 0.125], min_p=0.5) == {0, 1}  # 0.25 = 0.5 * 0.5 stays (vLLM)


def test_top_p_keeps_the_nucleus():
    assert sampled_tokens([0.5, 0.3, 0.15, 0.05], top_p=0.7) == {0, 1}  # 0.5 < 0.7: token 1 joins; 0.8 >= 0.7 stops


def test_min_p_drops_unlikely_tokens():
    assert sampled_tokens([0.6, 0.3, 0.1], min_p=0.4) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_the_softmax_of_the_logits_over_the_temperature(temperature):
    # The three expected distributions lie 0.075 or more apart in some token.
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()  # softmax(log(probs) / temperature)
    n = 20000  # a frequency's standard deviation is then <= 0.0036
    logits = jnp.asarray(np.log(probs)[None].repeat(n, 0), jnp.float32)
    tokens = np.asarray(sample(logits, metadata(n, temperature=temperature, seeds=np.arange(n))))
    np.testing.assert_allclose(np.bincount(tokens, minlength=4) / n, expected, atol=0.015)


def test_same_seed_and_position_give_the_same_token_whatever_the_batch():
    logits = random_logits(1, seed=3)
    alone = sample(logits, metadata(1, seeds=[42], positions=[5]))
    batch = jnp.concatenate([random_logits(3, seed=4), logits])
    together = sample(batch, metadata(4, seeds=[1, 2, 3, 42], positions=[0, 0, 0, 5]))
    assert int(alone[0]) == int(together[3])


def test_greedy_and_random_requests_mix_in_one_batch():
    logits = random_logits(8) / 3  # flat enough that a sampled token is rarely the argmax
    sampled = metadata(8)
    mixed = SamplingMetadata(jnp.asarray([0.0, 1.0] * 4), sampled.top_k, sampled.top_p, sampled.min_p,
                             sampled.seeds, sampled.positions)
    tokens, random_tokens = np.asarray(sample(logits, mixed)), np.asarray(sample(logits, sampled))
    argmax = np.argmax(logits, -1)
    assert (random_tokens[1::2] != argmax[1::2]).any()  # else this batch cannot tell sampling from argmax
    np.testing.assert_array_equal(tokens[0::2], argmax[0::2])
    np.testing.assert_array_equal(tokens[1::2], random_tokens[1::2])  # sampled as in an all-random batch


def test_a_row_without_filters_is_unaffected_by_filters_elsewhere_in_the_batch():
    logits = random_logits(1, vocab=49152, seed=7)
    alone = [int(sample(logits, metadata(1, seeds=[9], positions=[p]))[0]) for p in range(20)]
    batch = jnp.concatenate([logits, random_logits(1, vocab=49152, seed=8)])
    md = metadata(2, seeds=[9, 1])
    together = []
    for p in range(20):
        md = SamplingMetadata(md.temperature, jnp.asarray([0, 5], jnp.int32), jnp.asarray([1.0, 0.5]),
                              md.min_p, md.seeds, jnp.asarray([p, p], jnp.int32))
        together.append(int(sample(batch, md)[0]))
    assert alone == together


def test_min_p_applies_before_top_p():
    # min_p=0.4 leaves {0.5, 0.3} -> renormalised {0.625, 0.375}; top_p=0.6 then keeps token 0 alone
    # (top-p on the original distribution would keep token 1 too: 0.5 < 0.6).
    assert sampled_tokens([0.5, 0.3, 0.15, 0.05], min_p=0.4, top_p=0.6) == {0}


def test_64_bit_seeds_that_share_low_words_give_different_streams():
    logits = jnp.zeros((2, 1000), jnp.float32)
    streams = [[int(t) for t in sample(logits, metadata(2, seeds=[5, 5 + 2**32], positions=[p, p]))]
               for p in range(8)]
    assert [a for a, _ in streams] != [b for _, b in streams]


def sorted_filter(logits, top_k, top_p, min_p):
    """The filter by its definition, with a sort (numpy, one row): min-p, top-k, then the
    top-p nucleus of what is left; a threshold logit, so ties at it stay."""
    order = np.argsort(-logits, kind="stable")
    ranked = logits[order]
    probs = np.exp(ranked - ranked[0]) / np.exp(ranked - ranked[0]).sum()
    keep = probs >= min_p * probs[0]
    keep[(top_k if top_k > 0 else len(logits)):] = False
    kept = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    if top_p < 1.0:
        keep &= np.cumsum(kept) - kept < top_p
    return np.where(logits >= ranked[max(keep.sum(), 1) - 1], logits, -np.inf)


@pytest.mark.parametrize("in_a_loop", [True, False])  # a CPU's search, a GPU's
def test_the_filter_keeps_what_a_sort_keeps(in_a_loop, monkeypatch):
    monkeypatch.setattr(sampler, "_searches_in_a_loop", lambda: in_a_loop)
    rng = np.random.default_rng(7)
    n, vocab = 64, 500
    logits = (rng.standard_normal((n, vocab)) * rng.uniform(0.3, 4, (n, 1))).astype(np.float32)
    logits[:8, :20] = logits[:8, :1]  # ties at the top
    top_k = rng.choice([0, 1, 5, 50, 499, 600], n)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-6], n).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], n).astype(np.float32)
    md = SamplingMetadata(jnp.ones(n, jnp.float32), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p),
                          jnp.asarray(min_p), seed_words(np.arange(n)), jnp.zeros(n, jnp.int32))
    got = np.asarray(jax.jit(sampler._filter)(jnp.asarray(logits), md))
    no_top_k = np.asarray(jax.jit(sampler._filter, static_argnums=2)(jnp.asarray(logits), md, False))
    for i in range(n):
        want = sorted_filter(logits[i].astype(np.float64), top_k[i], top_p[i], min_p[i])
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {i}")
        if top_k[i] <= 0:  # NUCLEUS skips the top-k search: the same for a row without one
            np.testing.assert_array_equal(np.isfinite(no_top_k[i]), np.isfinite(want), err_msg=f"row {i}")
