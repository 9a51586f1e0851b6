"""The logits processors (jaxllm/sample/processors.py) against a plain numpy
reference on random logits: each penalty, the logit bias, allowed tokens, one-token bad
words, min_tokens and the host's bitmask, alone and mixed in one batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.core import token_masks
from jaxllm.sample import processors
from jaxllm.sample.sampler import ProcessorMetadata

VOCAB, NUM_ROWS = 70, 6  # 70: the bitmask's last word is partly padding


def reference(logits, req, bitmask_row):
    """One request's processed logits, written from vLLM's definitions, in float64."""
    out = logits.astype(np.float64).copy()
    allowed = [(bitmask_row[t // 32] >> (t % 32)) & 1 for t in range(len(out))]
    out[~np.asarray(allowed, bool)] = -np.inf
    if req.get("allowed") is not None:
        out[[t for t in range(len(out)) if t not in req["allowed"]]] = -np.inf
    for t, bias in req.get("bias", {}).items():
        out[t] += bias
    out[req.get("banned", [])] = -np.inf
    if len(req["output"]) < req.get("min_tokens", 0):
        out[req["stop"]] = -np.inf
    seen = set(req["prompt"]) | set(req["output"])
    rp = req.get("rep", 1.0)
    for t in seen:
        out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
    for t in set(req["output"]):
        out[t] -= req.get("freq", 0.0) * req["output"].count(t) + req.get("pres", 0.0)
    return out


def run(requests, bitmask=None, seed=0):
    """The processors on random logits for `requests` (dicts; None: a row without processors)."""
    rng = np.random.default_rng(seed)
    n = len(requests)
    logits = (rng.standard_normal((n, VOCAB)) * 3).astype(np.float32)
    if bitmask is None:
        bitmask = np.full((n, -(-VOCAB // 32)), -1, np.int32)
    state = processors.zero_state(NUM_ROWS, VOCAB)
    rows = np.full(processors.WRITE_ROWS, NUM_ROWS, np.int32)
    values = [np.zeros((processors.WRITE_ROWS, VOCAB), dt) for dt in (np.int32, bool, np.float32, bool)]
    for i, req in enumerate(requests):
        if req is None:
            continue
        rows[i] = NUM_ROWS - 1 - i  # any rows, not the batch's order
        for array, value in zip(values, processors.request_state_rows(
                req["prompt"], req["output"], req.get("bias"), req.get("allowed"), req.get("banned", []),
                req.get("stop", []), VOCAB)):
            array[i] = value
    state = jax.jit(processors.write_rows)(state, rows, *values)
    processed = np.array([r is not None for r in requests])
    get = lambda key, default: np.array([default if r is None else r.get(key, default) for r in requests])
    md = ProcessorMetadata(
        presence_penalty=jnp.float32(get("pres", 0.0)), frequency_penalty=jnp.float32(get("freq", 0.0)),
        repetition_penalty=jnp.float32(get("rep", 1.0)), min_tokens=jnp.int32(get("min_tokens", 0)),
        num_prompt_tokens=jnp.int32([0 if r is None else len(r["prompt"]) for r in requests]),
        processed=jnp.asarray(processed),
        positions=jnp.int32([0 if r is None else len(r["prompt"]) + len(r["output"]) for r in requests]),
        state_rows=jnp.int32(np.where(processed, rows[:n], 0)),
        update_rows=jnp.int32(np.where(processed, rows[:n], -1)), drafts=jnp.full(n, -1, jnp.int32),
        segment_starts=jnp.arange(n, dtype=jnp.int32))
    out = np.asarray(jax.jit(processors.apply_processors)(logits, md, state, bitmask))
    return logits, out, md, state


def request(**kwargs):
    rng = np.random.default_rng(len(kwargs))
    return {"prompt": rng.integers(0, VOCAB, 7).tolist(), "output": rng.integers(0, VOCAB, 9).tolist(),
            "stop": [2, 5], **kwargs}


CASES = {
    "repetition above 1": request(rep=1.7),
    "repetition below 1": request(rep=0.6),
    "presence": request(pres=1.5),
    "negative presence": request(pres=-2.0),
    "frequency": request(freq=0.7),
    "logit bias": request(bias={3: 5.0, 4: -7.5, 69: 100.0}),
    "allowed token ids": request(allowed=[1, 8, 13, 69]),
    "bad words of one token": request(banned=[0, 9, 33]),
    "min_tokens in force": request(min_tokens=10),
    "min_tokens reached": request(min_tokens=9),
    "everything": request(rep=1.3, pres=0.4, freq=0.2, bias={7: 2.0}, allowed=list(range(0, 70, 2)), banned=[4],
                          min_tokens=20),
}


@pytest.mark.parametrize("name", CASES)
def test_a_processor_matches_the_reference(name):
    logits, out, _, _ = run([CASES[name]])
    np.testing.assert_allclose(out[0], reference(logits[0], CASES[name], [-1] * 3), rtol=1e-6, atol=1e-5)


def test_a_batch_mixing_processors_treats_each_row_as_alone_and_leaves_plain_rows_unchanged():
    requests = [CASES["repetition above 1"], None, CASES["everything"], CASES["min_tokens in force"], None]
    logits, out, _, _ = run(requests)
    for i, req in enumerate(requests):
        want = logits[i] if req is None else reference(logits[i], req, [-1] * 3)
        np.testing.assert_allclose(out[i], want, rtol=1e-6, atol=1e-5)


def test_the_host_bitmask_masks_exactly_the_cleared_bits():
    bitmask = np.full((2, 3), -1, np.int32)
    for t in (0, 31, 32, 69):
        token_masks.forbid(bitmask[0], t)
    bitmask[1] = 0
    bitmask[1, 0], bitmask[1, 1] = 1 << 5, np.uint32(1 << 31).view(np.int32)  # tokens 5 and 63
    req = request()
    logits, out, _, _ = run([req, req], bitmask)
    for i in range(2):
        np.testing.assert_allclose(out[i], reference(logits[i], req, bitmask[i].view(np.uint32)), rtol=1e-6,
                                   atol=1e-5)
    assert np.isinf(out[0, [0, 31, 32, 69]]).all() and np.isfinite(np.delete(out[0], [0, 31, 32, 69])).all()
    assert set(np.flatnonzero(np.isfinite(out[1]))) == {5, 63}


def test_a_sampled_token_is_counted_in_its_rows_output_counts_only():
    requests = [request(pres=1.0), None, request(freq=1.0)]
    _, _, md, state = run(requests)
    before = np.asarray(state.output_counts)
    after = np.asarray(jax.jit(processors.count_sampled)(state, md, jnp.int32([11, 12, 13])).output_counts)
    diff = after - before
    rows = np.asarray(md.state_rows)
    assert diff[rows[0], 11] == 1 and diff[rows[2], 13] == 1 and diff.sum() == 2  # the plain row counts nothing


def test_state_rows_count_the_output_and_mark_the_prompt():
    counts, prompt_mask, bias, stop = processors.request_state_rows([4, 4, 9], [1, 1, 1, 6], {6: 2.0}, None, [8],
                                                                    [2], 12)
    assert counts.tolist() == [0, 3, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert np.flatnonzero(prompt_mask).tolist() == [4, 9]
    assert bias[6] == 2.0 and bias[8] == -np.inf and np.count_nonzero(bias) == 2
    assert np.flatnonzero(stop).tolist() == [2]
