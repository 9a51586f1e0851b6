"""Granite 4.0-H (models/granite_hybrid.py) on CPU: against HF transformers' fp32 outputs for the tiny
random model in tests/fixtures/tiny/granite_hybrid (scripts/make_fixtures.py), whole prompts and in
chunks, and through the engine: greedy tokens, logprobs, prompt logprobs of chunked prefills, and the
hybrid KV cache (attention's blocks and Mamba's state slots) through preemption and aborts. Its
experts also test what the engine tells of any MoE model's routing: the experts returned with the
samples (SamplingParams.return_routed_experts) and the per-expert token counts of /metrics."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.device_facts import DeviceFacts
from jaxllm.engine.processor import Processor
from jaxllm.entrypoints.openai.metrics import ServerMetrics
from jaxllm.kernels.attention import get_attention_fn
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout, model_kv_specs
from jaxllm.models.loader import abstract_params, create_model, iter_hf_weights
from jaxllm.sharding import make_mesh
from tests.conftest import tiny_model
from tests.models.state_checks import (ATOL, assert_chunked_prompt_logprobs_are_hfs, chunked_logits,
                                       hf_prompt_logprobs, run_through_aborts_and_a_pause)
from tests.models.test_moe import assert_greedy_is_hfs, assert_routed_experts_are_a_plain_forwards

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

MODEL = tiny_model("granite_hybrid")
GOLDEN = np.load(os.path.join(MODEL, "golden.npz"))
BLOCK_SIZE = 16
# 8 blocks of 16 tokens: one request of max_model_len; four running requests of 40-odd tokens preempt.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=8,
              block_size=BLOCK_SIZE, skip_tokenizer_init=True, show_progress=False, enable_multiprocessing=False)


def hf_config() -> dict:
    with open(os.path.join(MODEL, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model_step():
    """The model with the checkpoint's weights, one jitted step over a 128-token bucket and 2 requests
    (one padding), and a maker of its caches: 8 blocks per attention layer, 4 state slots per Mamba one."""
    config = ModelArchConfig.from_hf_config(hf_config())
    model = create_model(config, dtype=jnp.float32, mesh=make_mesh(1), weights=iter_hf_weights(MODEL))
    graphdef, state = nnx.split(model)
    layout, specs = model_kv_layout(config), model_kv_specs(config, BLOCK_SIZE)
    attention = get_attention_fn("reference")

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(caches, input_ids, md):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(input_ids, jnp.zeros_like(input_ids), caches, md, attention)
        return m.compute_logits(hidden), caches

    def make_caches():
        return [tuple(jnp.zeros(a.shape, a.dtype) for a in spec.arrays(4 if t in layout.state_tensors() else 8,
                                                                          jnp.float32, jnp.float32))
                for t, spec in enumerate(specs)]
    return step, make_caches


@pytest.mark.parametrize("length, chunks", [(1, [1]), (7, [7]), (33, [33]), (100, [100]), (7, [1, 1, 5]),
                                            (33, [15, 1, 17]), (100, [40, 3, 57])])
def test_logits_match_hf_transformers_whole_and_in_chunks(model_step, length, chunks):
    """Chunks that continue from the K/V the one before wrote in blocks 0-7 and the states it left in slot 2."""
    step, make_caches = model_step

    def slot_mapping(start, n):  # the request's tokens in blocks 0-7, in order
        slots = np.full((2, 128), -1, np.int32)
        slots[0, :n] = np.arange(start, start + n)
        return slots

    block_tables = np.zeros((2, 2, 8), np.int32)
    block_tables[0, 0], block_tables[1, 0, 0] = np.arange(8), 2
    logits = chunked_logits(step, make_caches(), GOLDEN[f"prompt_{length}"], chunks, slot_mapping, block_tables)
    np.testing.assert_allclose(logits, GOLDEN[f"logits_{length}"], atol=ATOL, rtol=0)


def test_the_layout_puts_attention_blocks_first_and_mamba_states_after():
    layout = model_kv_layout(ModelArchConfig.from_hf_config(hf_config()))
    assert [(g.layers, g.mamba, g.first_tensor) for g in layout.groups] == [((1, 3), False, 0), ((0, 2), True, 2)]
    assert layout.hybrid and layout.state_tensors() == range(2, 4)
    assert [layout.layer_slot(i) for i in range(4)] == [(1, 2), (0, 0), (1, 3), (0, 1)]


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, **ENGINE) as llm:
        yield llm


def test_greedy_tokens_and_logprobs_match_hf(llm):
    """(Nothing compiles after warm-up: run_through_aborts_and_a_pause checks it over many steps.)"""
    assert_greedy_is_hfs(llm, "granite_hybrid")


def test_chunked_prefills_of_any_split_give_hfs_prompt_logprobs(llm):
    """The 100-token prompt in chunks of the 32-token budget, alone and behind other requests that
    move its chunks' boundaries; the 33-token one likewise."""
    assert_chunked_prompt_logprobs_are_hfs(llm, GOLDEN, ([], [3], [20, 9]))


def all_free(stats: dict) -> bool:
    return (stats["num_free_blocks"] == stats["num_blocks"]
            and stats["num_free_state_slots"] == stats["num_state_slots"])


def test_preemption_and_aborts_leave_every_block_and_state_slot_free_and_the_others_outputs(llm):
    """Six requests on four state slots and eight blocks: the KV blocks run short and preempt; two are
    aborted; a pause that keeps the requests preempts every running one, which recomputes from scratch.
    The golden prompt's tokens stay HF's, the others' what each gives alone, and every block and slot ends free."""
    before, stats = run_through_aborts_and_a_pause(llm, GOLDEN, (40, 5, 61, 17, 45), all_free)
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert all_free(stats) and (stats["num_blocks"], stats["num_state_slots"]) == (8, 4)


def test_the_plain_logprobs_function_gives_hfs(llm):
    """LLM.get_logprobs_fn (a trainer's view: the model over its own zero caches) on the 33-token prompt."""
    fn = jax.jit(llm.get_logprobs_fn())
    logprobs = np.asarray(fn(llm.get_params(), jnp.asarray(GOLDEN["prompt_33"], jnp.int32)))
    np.testing.assert_allclose(logprobs, hf_prompt_logprobs(GOLDEN, 33), atol=ATOL, rtol=0)


def test_bundled_granite_4_0_h_tiny_has_its_size_and_layout():
    """7B parameters (1B active); attention at layers 5, 15, 25, 35, in KV tensors 0-3, the 36 Mamba layers'
    states after."""
    config = EngineArgs(model="granite-4.0-h-tiny", load_format="dummy").create_config()
    assert not config.cache.enable_prefix_caching
    arch = config.model.arch
    _, params = abstract_params(arch, jnp.bfloat16)
    assert sum(int(np.prod(var.shape)) for var in params.values()) == pytest.approx(6.94e9, rel=0.01)
    layout = model_kv_layout(arch)
    assert layout.groups[0].layers == (5, 15, 25, 35) and layout.state_tensors() == range(4, 40)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["mamba", "attention"]}, "'layer_types' must name 4 layers"),
    ({"layer_types": ["mamba", "attention", "conv", "mamba"]}, "'layer_types'"),
    ({"mamba_d_head": 5}, "'mamba_n_heads' \\* 'mamba_d_head'"),
    ({"position_embedding_type": "alibi"}, "'position_embedding_type'"),
    ({"embedding_multiplier": "2"}, "'embedding_multiplier' must be of type float"),
])
def test_a_bad_granite_config_names_its_key(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config({**hf_config(), **change})


def test_granite_over_several_devices_takes_tensor_and_expert_parallelism_and_refuses_dual_batch_overlap():
    """Over 8 devices, tensor_parallel_size=2 with or without enable_expert_parallel passes the checks
    (their outputs: tests/engine/test_tensor_parallel.py, test_expert_parallel.py); enable_dbo does not
    run Mamba layers yet."""
    eight = DeviceFacts("cpu", 8, "reference")
    assert not EngineArgs(model=MODEL, tensor_parallel_size=2).create_config(eight).model.arch.moe.expert_parallel
    config = EngineArgs(model=MODEL, tensor_parallel_size=2, enable_expert_parallel=True).create_config(eight)
    assert config.parallel.tensor_parallel_size == 2 and config.model.arch.moe.expert_parallel
    with pytest.raises(ValueError, match="enable_dbo does not run with a Mamba model yet"):
        EngineArgs(model=MODEL, tensor_parallel_size=2, enable_dbo=True).create_config(eight)


def test_routed_experts_are_the_routers_choices_in_a_plain_forward_and_only_for_requests_that_ask(llm):
    """Two requests that ask (the 33-token prompt prefilled in two chunks, and the golden one) beside one that
    does not: each generated token's row is what every MoE layer chose at the token before it (the forward
    that sampled it) in the model's plain forward over the whole sequence; nothing compiles after warm-up."""
    before = llm.llm_engine.get_stats()["num_compilations"]
    asks = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True)
    prompts = [GOLDEN["prompt_33"].tolist(), GOLDEN["greedy_prompt"].tolist(), [3, 4, 5]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [asks, asks, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)], use_tqdm=False)
    assert llm.llm_engine.get_stats()["num_compilations"] == before
    assert outputs[2].outputs[0].routed_experts is None
    assert_routed_experts_are_a_plain_forwards("granite_hybrid", prompts[:2], outputs[:2])


def test_routed_experts_of_a_model_without_experts_are_refused_at_the_request():
    config = EngineArgs(model=tiny_model("llama"), skip_tokenizer_init=True).create_config()
    with pytest.raises(ValueError, match="return_routed_experts"):
        Processor(config, None).process({"prompt_token_ids": [1, 2]}, SamplingParams(return_routed_experts=True))


def test_the_expert_token_counts_reach_the_metrics_and_add_up_to_every_token_run(llm):
    """Each token the model runs (a prompt's, and every generated one but the last) counts once per expert of
    its top k in each MoE layer: jaxllm:moe_expert_tokens_total{layer, expert} over a run sums to
    tokens * top_k * moe_layers."""
    metrics = ServerMetrics("granite", 128, moe_layers=(0, 1, 2, 3))
    llm.llm_engine.stats_listeners.append(metrics.record_scheduler_stats)
    try:
        lengths, max_tokens = (7, 33, 50), 5
        llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in lengths],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.stats_listeners.remove(metrics.record_scheduler_stats)
    run = sum(lengths) + len(lengths) * (max_tokens - 1)
    totals = metrics.expert_tokens.totals
    assert totals.shape == (4, 8) and (totals.sum(axis=1) == run * 2).all()
    text = metrics.render().decode()
    series = [line for line in text.splitlines() if line.startswith("jaxllm:moe_expert_tokens_total{")]
    assert len(series) == 4 * 8 and 'layer="3"' in text
    assert sum(float(line.rsplit(" ", 1)[1]) for line in series) == run * 2 * 4
