"""Prefix caching end to end: outputs equal with the cache on and off (greedy and seeded,
with preemption and aborts), the hit counters, no compilation on hits, and the hybrid
KV cache of a model with sliding-window layers against one plain forward pass (on a GPU
too, through each of its attention backends, with prefix hits)."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import reference
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.loader import create_model, iter_weights, quantize_model
from jaxllm.models.quant_config import resolve_quantization
from jaxllm.sharding import make_mesh
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

BLOCK = 16
# A tight pool: 8 requests of up to ~140 tokens want ~70 blocks, so the run preempts.
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=24,
              skip_tokenizer_init=True, show_progress=False, enable_multiprocessing=False)


def shared_prefix_prompts(seed=0, num=16):
    """Token-id prompts over three shared prefixes (40, 70 and 33 tokens) with suffixes of 1-40."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 256, n).tolist() for n in (40, 70, 33)]
    return [{"prompt_token_ids": prefixes[i % 3] + rng.integers(3, 256, int(rng.integers(1, 40))).tolist()}
            for i in range(num)]


@pytest.fixture(scope="module")
def engines():
    with LLM(tiny_model("llama"), enable_prefix_caching=True, **ENGINE) as cached, \
            LLM(tiny_model("llama"), enable_prefix_caching=False, **ENGINE) as uncached:
        yield cached, uncached


def run_with_aborts(llm, prompts, params, abort_ids=(), abort_after_steps=3):
    """Every request through the engine's step loop; `abort_ids` aborted after a few steps.
    Returns {request id: output token ids} of the requests that finished."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                outputs[out.request_id] = (list(out.outputs[0].token_ids), out.num_cached_tokens)
        steps += 1
        if steps == abort_after_steps and abort_ids:
            engine.abort_request(list(abort_ids))
    return outputs


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_outputs_equal_with_the_cache_on_and_off_through_preemption(engines, params):
    cached, uncached = engines
    prompts = shared_prefix_prompts()
    before = cached.llm_engine.get_stats()
    on = [o.outputs[0].token_ids for o in cached.generate(prompts, params, use_tqdm=False)]
    off = [o.outputs[0].token_ids for o in uncached.generate(prompts, params, use_tqdm=False)]
    assert on == off
    stats = cached.llm_engine.get_stats()
    assert stats["num_preemptions"] > before["num_preemptions"]  # the pool was short
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_aborted_requests_leave_the_others_outputs_and_every_block(engines):
    cached, uncached = engines
    prompts = shared_prefix_prompts(seed=1, num=10)
    params = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    aborted = ["1", "4", "7"]
    on = run_with_aborts(cached, prompts, params, aborted)
    off = run_with_aborts(uncached, prompts, params)
    assert set(on) == set(off) - set(aborted)
    assert {i: tokens for i, (tokens, _) in on.items()} == {i: off[i][0] for i in on}
    assert any(num_cached > 0 for _, num_cached in on.values())
    assert all(num_cached == 0 for _, num_cached in off.values())
    for llm in engines:
        stats = llm.llm_engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_requests"] == 0


def test_a_prefix_evicted_while_a_request_hits_it_gives_the_same_output(engines):
    cached, uncached = engines
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 96).tolist()  # 6 blocks, cached by the first request
    first = [{"prompt_token_ids": shared + [5]}]
    # Then, together: a long request that needs most of the pool (it evicts the shared
    # prefix's blocks from the free queue's head) and two that hit the prefix.
    rest = [{"prompt_token_ids": rng.integers(3, 256, 200).tolist()},
            {"prompt_token_ids": shared + [9, 10]}, {"prompt_token_ids": shared[:64] + [11]}]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for llm in engines:
        llm.generate(first, params, use_tqdm=False)
    on = [o.outputs[0].token_ids for o in cached.generate(rest, params, use_tqdm=False)]
    off = [o.outputs[0].token_ids for o in uncached.generate(rest, params, use_tqdm=False)]
    assert on == off


def test_reset_prefix_cache_forgets_the_cached_prompts(engines):
    cached, _ = engines
    prompt = [{"prompt_token_ids": list(range(3, 60))}]
    params = SamplingParams(max_tokens=2, temperature=0)
    cached.generate(prompt, params, use_tqdm=False)
    assert cached.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 48
    assert cached.reset_prefix_cache()
    assert cached.llm_engine.get_stats()["num_cached_blocks"] == 0
    assert cached.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_prefix_hits_of_every_length_compile_nothing(engines):
    cached, _ = engines
    base = list(range(3, 3 + 6 * BLOCK))
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=1)
    cached.generate([{"prompt_token_ids": base + [200]}], params, use_tqdm=False)
    before = cached.llm_engine.get_stats()["num_compilations"]
    outs = cached.generate([{"prompt_token_ids": base[:n * BLOCK] + [201, 202]} for n in range(7)], params,
                           use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [n * BLOCK for n in range(7)]
    assert cached.llm_engine.get_stats()["num_compilations"] == before


# ---- the hybrid KV cache ----

WINDOW = 24  # sliding layers see 24 tokens: 2-3 blocks of 16


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """The tiny Qwen2 with its second layer on a sliding window: two KV cache groups."""
    folder = tmp_path_factory.mktemp("hybrid")
    for name in os.listdir(tiny_model("qwen2")):
        if name != "golden.npz":
            shutil.copy(os.path.join(tiny_model("qwen2"), name), folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(use_sliding_window=True, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"])
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder), ModelArchConfig.from_hf_config(config)


def plain_forward_logits(path, arch, token_ids, quantization=None):
    """Logits [n, vocab] of one forward pass over the whole sequence, every block held; quantization:
    EngineArgs' (None: the checkpoint's quantization_config; "fp8" on an unquantized checkpoint: its
    Linears quantized on load)."""
    with open(os.path.join(path, "config.json")) as f:
        quant = resolve_quantization(quantization, json.load(f), "hf")
    model = create_model(arch, dtype=jnp.float32, mesh=make_mesh(), weights=iter_weights(path, "hf", quant),
                         quantization=quant)
    quantize_model(model, quant, make_mesh())
    layout = model_kv_layout(arch)
    num_groups, n = len(layout.groups), len(token_ids)
    blocks = -(-n // BLOCK)
    shape = (num_groups * blocks, BLOCK, arch.num_kv_heads, arch.head_dim)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(layout.num_tensors)]
    tables = np.stack([g * blocks + np.arange(blocks, dtype=np.int32) for g in range(num_groups)])[:, None]
    pos = np.arange(n, dtype=np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(tables[:, 0, pos // BLOCK] * BLOCK + pos % BLOCK),
                           query_start_loc=jnp.array([0, n], jnp.int32), seq_lens=jnp.array([n], jnp.int32),
                           block_tables=jnp.asarray(tables), num_seqs=jnp.array([1], jnp.int32))
    hidden, _ = model(jnp.asarray(token_ids, jnp.int32), jnp.asarray(pos), caches, md,
                      reference.ragged_paged_attention)
    return np.asarray(model.compute_logits(hidden))


@pytest.fixture(scope="module")
def tiny_gemma3():
    """The tiny Gemma 3: sliding layers 0 and 2 (window 8), full attention in layer 1."""
    with open(os.path.join(tiny_model("gemma3"), "config.json")) as f:
        return tiny_model("gemma3"), ModelArchConfig.from_hf_config(json.load(f))


@pytest.mark.parametrize("model, windows", [("hybrid_model", [None, WINDOW]), ("tiny_gemma3", [None, 8, 8])])
def test_hybrid_kv_cache_decodes_as_one_forward_pass_with_the_window(request, model, windows):
    path, arch = request.getfixturevalue(model)
    assert [g.sliding_window for g in model_kv_layout(arch).groups] == windows
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (90, 37, 61)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # Chunks of 32 and a pool that reuses the blocks falling out of the window at once.
    with LLM(path, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32, num_gpu_blocks_override=40,
             skip_tokenizer_init=True, show_progress=False, enable_multiprocessing=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    for prompt, out in zip(prompts, outs):
        generated = list(out.outputs[0].token_ids)
        logits = plain_forward_logits(path, arch, prompt + generated)
        expected = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        assert generated == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "mosaic", "triton"])
@pytest.mark.parametrize("model", ["hybrid_model", "tiny_gemma3"])
def test_hybrid_kv_cache_and_prefix_hits_through_a_gpu_backend(request, model, backend):
    """The GPU kernels over the hybrid cache: chunks of 32 and a pool of 60 blocks, so blocks leave
    the windows and are reused, and three of four prompts share a 48-token prefix that an earlier
    request cached. Greedy outputs equal one plain forward pass's argmax, each prompt finds its
    cached blocks (the first its own 5 full blocks, the next two the prefix's 3), and every block
    comes back."""
    path, arch = request.getfixturevalue(model)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 256, 48).tolist()
    prompts = [shared + rng.integers(3, 256, n).tolist() for n in (42, 13, 77)] + [rng.integers(3, 256, 90).tolist()]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(path, dtype="float32", attention_backend=backend, max_model_len=256, max_num_seqs=4,
             max_num_batched_tokens=32, num_gpu_blocks_override=60, skip_tokenizer_init=True,
             show_progress=False) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # caches the shared prefix
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    assert [o.num_cached_tokens for o in outs] == [80, 48, 48, 0]
    assert stats["num_free_blocks"] == stats["num_blocks"]
    for prompt, out in zip(prompts, outs):
        generated = list(out.outputs[0].token_ids)
        logits = plain_forward_logits(path, arch, prompt + generated)
        assert generated == logits[len(prompt) - 1:-1].argmax(-1).tolist()
