"""Checks shared by the models with Mamba state slots (tests/models/test_mamba2.py and
test_granite_hybrid.py): prompt logprobs of chunked prefills against HF's, and a run of requests
through preemption, aborts and a pause that keeps them."""
import jax.numpy as jnp
import numpy as np

from jaxllm import SamplingParams
from jaxllm.kernels.attention import AttentionMetadata

ATOL = 1e-4  # fp32 against HF's fp32: observed ~2e-6 on logits and ~5e-7 on logprobs


def hf_prompt_logprobs(golden, length: int) -> np.ndarray:
    """HF's logprob of each prompt token after the first, from the fixture's logits."""
    logits = golden[f"logits_{length}"].astype(np.float64)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logprobs[np.arange(length - 1), golden[f"prompt_{length}"][1:]]


def chunked_logits(step, caches, ids, chunks, slot_mapping, block_tables) -> np.ndarray:
    """The logits [len(ids), vocab] of one request's ids fed in chunks of `chunks` tokens, each the next
    step(caches, tokens [128], md) -> (logits [128, vocab], caches) over 2 requests (one padding), each
    chunk's K/V slots slot_mapping(start, n) [groups, 128], block_tables [groups, 2, blocks]."""
    logits, start = [], 0
    for n in chunks:
        tokens = np.zeros(128, np.int32)
        tokens[:n] = ids[start:start + n]
        md = AttentionMetadata(slot_mapping=jnp.asarray(slot_mapping(start, n)),
                               query_start_loc=jnp.array([0, n, n], jnp.int32),
                               seq_lens=jnp.array([start + n, 0], jnp.int32), block_tables=jnp.asarray(block_tables),
                               num_seqs=jnp.array([1], jnp.int32))
        out, caches = step(caches, jnp.asarray(tokens), md)
        logits.append(np.asarray(out[:n]))
        start += n
    return np.concatenate(logits)


def assert_chunked_prompt_logprobs_are_hfs(llm, golden, others_lengths) -> None:
    """The 100- and 33-token prompts chunked by the token budget, behind other requests of each of
    others_lengths (lists of prompt lengths) that move their chunks' boundaries."""
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    for others in others_lengths:
        prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in others]
        prompts += [{"prompt_token_ids": golden[f"prompt_{n}"].tolist()} for n in (100, 33)]
        outputs = llm.generate(prompts, params, use_tqdm=False)[len(others):]
        for out, length in zip(outputs, (100, 33)):
            got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
            np.testing.assert_allclose(got, hf_prompt_logprobs(golden, length), atol=ATOL, rtol=0)


def run_through_aborts_and_a_pause(llm, golden, other_lengths, all_free) -> dict:
    """The golden greedy prompt and random prompts of other_lengths as requests "0", "1", ... stepped
    by hand: "2" and "4" aborted at step 3; at step 5 a pause that keeps them preempts every running
    request, all_free(stats) then true, and they resume. Checks the golden prompt's tokens are HF's and
    each other finished request's what it gives alone, and that nothing compiled. Returns the stats
    before and after."""
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": golden["greedy_prompt"].tolist()}]
    prompts += [{"prompt_token_ids": rng.integers(3, 256, int(n)).tolist()} for n in other_lengths]
    params = SamplingParams(max_tokens=len(golden["greedy_tokens"]), temperature=0, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    before = engine.get_stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step()
                        if o.finished and o.outputs[0].finish_reason != "abort"})
        steps += 1
        if steps == 3:
            engine.abort_request(["2", "4"])
        if steps == 5:
            engine.pause_generation("keep")
            stats = engine.get_stats()
            assert stats["num_running"] == 0 and all_free(stats)
            engine.resume_generation()
    assert outputs.keys() == {str(i) for i in range(len(prompts))} - {"2", "4"}
    assert outputs["0"] == golden["greedy_tokens"].tolist()
    assert all(outputs[i] == list(alone[int(i)]) for i in outputs)
    after = engine.get_stats()
    assert after["num_compilations"] == before["num_compilations"]
    return before, after
