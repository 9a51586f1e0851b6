"""The mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) and their MoE layer, on CPU.

Parity is against HF transformers' fp32 outputs stored in tests/fixtures/tiny/<name>/golden.npz
(scripts/make_fixtures.py): the logits of whole prompts, and a greedy continuation with each
token's logprob. The experts returned with the samples (return_routed_experts) are checked against
a plain forward of the whole sequence (assert_routed_experts_are_a_plain_forwards, which the
DeepSeek and Granite tests use too). The layer's expert-parallel and tensor-parallel forms are
checked against a per-token reference over 1, 2, 4 and 8 devices; in a process with fewer, the last
test runs those in a child with 8 forced host devices.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.kernels.attention import AttentionMetadata, get_attention_fn
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fp8 import Fp8Linear, quantize_experts
from jaxllm.models.kv_layout import model_kv_layout, model_kv_specs
from jaxllm.models.llama import Linear
from jaxllm.models.loader import abstract_params, create_model, iter_hf_weights
from jaxllm.models.moe import moe_expert_parallel, moe_one_device, moe_tensor_parallel, recording_routing, route
from jaxllm.sharding import make_mesh, named_sharding, replicated
from tests.conftest import run_with_host_devices, tiny_model
from tests.models.test_llama import assert_logits_match_hf, load_fixture

MOE_MODELS = ("qwen3_moe", "qwen2_moe", "mixtral")
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, skip_tokenizer_init=True,
              show_progress=False, enable_multiprocessing=False)
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")


def fixture_hf_config(name: str) -> dict:
    with open(os.path.join(tiny_model(name), "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_logits_match_hf_transformers(name):
    assert_logits_match_hf(name, *load_fixture(name))


def assert_greedy_is_hfs(llm, name, logprobs_too=True):
    """The engine's greedy continuation of the golden prompt is HF's, and (logprobs_too) so is each
    token's logprob."""
    golden = np.load(os.path.join(tiny_model(name), "golden.npz"))
    prompt = {"prompt_token_ids": golden["greedy_prompt"].tolist()}
    params = SamplingParams(max_tokens=len(golden["greedy_tokens"]), temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == golden["greedy_tokens"].tolist()
    if logprobs_too:
        logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        np.testing.assert_allclose(logprobs, golden["greedy_logprobs"], atol=1e-4)


def plain_forward_routing(name: str):
    """fn(token_ids [n] int32) -> [n, moe_layers, k] int32: what every MoE layer's router chose at each
    token in one plain forward of the whole sequence (the checkpoint's weights on one device, one
    block of 128 tokens or one state slot per KV tensor, the reference attention)."""
    config = ModelArchConfig.from_hf_config(fixture_hf_config(name))
    model = create_model(config, dtype=jnp.float32, mesh=make_mesh(1), weights=iter_hf_weights(tiny_model(name)))
    graphdef, state = nnx.split(model)
    num_groups = len(model_kv_layout(config).groups)
    caches = [tuple(jnp.zeros(a.shape, a.dtype) for a in spec.arrays(1, jnp.float32, jnp.float32))
              for spec in model_kv_specs(config, 128)]

    @jax.jit
    def routing(token_ids):
        n = token_ids.shape[0]
        md = AttentionMetadata(slot_mapping=jnp.tile(jnp.arange(n, dtype=jnp.int32), (num_groups, 1)),
                               query_start_loc=jnp.array([0, n], jnp.int32), seq_lens=jnp.array([n], jnp.int32),
                               block_tables=jnp.zeros((num_groups, 1, 1), jnp.int32),
                               num_seqs=jnp.array([1], jnp.int32))
        with recording_routing() as recorded:
            nnx.merge(graphdef, state)(token_ids, jnp.arange(n, dtype=jnp.int32), caches, md,
                                       get_attention_fn("reference"))
        return jnp.stack(recorded, axis=1)
    return routing


def assert_routed_experts_are_a_plain_forwards(name: str, prompts: list[list[int]], outputs) -> None:
    """Each generated token's row of routed_experts [tokens, moe_layers, k] is what every MoE layer chose
    at the token before it (the forward that sampled it) in the plain forward of prompt + tokens."""
    config = ModelArchConfig.from_hf_config(fixture_hf_config(name))
    routing = plain_forward_routing(name)
    for prompt, out in zip(prompts, outputs):
        tokens, routed = list(out.outputs[0].token_ids), out.outputs[0].routed_experts
        assert routed.shape == (len(tokens), len(config.moe.sparse_layers), config.moe.top_k)
        assert routed.dtype == np.int32
        plain = np.asarray(routing(jnp.asarray(prompt + tokens[:-1], jnp.int32)))
        np.testing.assert_array_equal(routed, plain[len(prompt) - 1:])


@pytest.mark.parametrize("name", MOE_MODELS)
@pytest.mark.usefixtures("warm_up")
def test_greedy_tokens_and_logprobs_match_hf_transformers_and_nothing_compiles_after_warm_up(name):
    with LLM(tiny_model(name), **ENGINE) as llm:
        before = llm.llm_engine.get_stats()["num_compilations"]
        assert_greedy_is_hfs(llm, name)
        assert llm.llm_engine.get_stats()["num_compilations"] == before


def test_routed_experts_are_the_routers_choices_in_a_plain_forward():
    """Qwen3-MoE (a dense layer between its two sparse ones): a 40-token prompt prefilled in two chunks of
    the 32-token budget and a short one ask, beside one that does not."""
    prompts = [list(range(3, 43)), [5, 17, 99, 3, 250, 41, 8], [7, 8, 9]]
    asks = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True)
    with LLM(tiny_model("qwen3_moe"), **ENGINE) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [asks, asks, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)],
                               use_tqdm=False)
    assert outputs[2].outputs[0].routed_experts is None
    assert_routed_experts_are_a_plain_forwards("qwen3_moe", prompts[:2], outputs[:2])


@pytest.mark.parametrize("layout", ["engine", "hf"])
def test_params_in_memory_give_the_checkpoints_outputs(layout):
    """Qwen2-MoE's stacked experts and shared expert packed from HF-named arrays, or handed back."""
    if layout == "hf":
        params = load_file(os.path.join(tiny_model("qwen2_moe"), "model.safetensors"))
    else:
        with LLM(tiny_model("qwen2_moe"), **ENGINE) as llm:
            params = jax.tree.map(np.asarray, llm.get_params())
    with LLM(tiny_model("qwen2_moe"), params=params, **ENGINE) as llm:
        assert_greedy_is_hfs(llm, "qwen2_moe")


def test_fp8_quantizes_the_linears_and_experts_but_not_the_routers():
    """quantization="fp8": attention, dense MLPs and the experts in e4m3 (the experts with a scale per
    expert and output channel); the routers as loaded."""
    with LLM(tiny_model("qwen3_moe"), quantization="fp8", **ENGINE) as llm:
        model = llm.llm_engine.engine_core.core.executor.runner.weights.model()
        assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
        assert isinstance(model.layers[1].mlp.down_proj, Fp8Linear)  # the dense layer
        assert type(model.layers[0].mlp.gate) is Linear
        experts = model.layers[0].mlp.experts
        assert experts.gate_up_proj[...].dtype == experts.down_proj[...].dtype == jnp.float8_e4m3fn
        e, hidden, _, inter = experts.gate_up_proj.shape
        assert experts.gate_up_proj_scale.shape == (e, 2, inter) and experts.down_proj_scale.shape == (e, hidden)
        assert_greedy_is_hfs(llm, "qwen3_moe", logprobs_too=False)
        # New weights are quantized as they come: the experts doubled, the same e4m3 values at twice the scales.
        before = [np.asarray(a[...]) for a in (experts.down_proj, experts.down_proj_scale)]
        params = load_file(os.path.join(tiny_model("qwen3_moe"), "model.safetensors"))
        llm.update_weights({name: 2 * w if ".experts." in name else w for name, w in params.items()})
        experts = llm.llm_engine.engine_core.core.executor.runner.weights.model().layers[0].mlp.experts
        np.testing.assert_array_equal(np.asarray(experts.down_proj[...]), before[0])
        np.testing.assert_allclose(np.asarray(experts.down_proj_scale[...]), 2 * before[1], rtol=1e-6)


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    d = fixture_hf_config("qwen3_moe")  # 3 layers, mlp_only_layers [1]
    assert ModelArchConfig.from_hf_config(d).moe.sparse_layers == (0, 2)
    d.update(mlp_only_layers=[], decoder_sparse_step=2)  # every second layer, counting from 1
    assert ModelArchConfig.from_hf_config(d).moe.sparse_layers == (1,)
    mixtral = ModelArchConfig.from_hf_config(fixture_hf_config("mixtral"))
    assert (mixtral.moe.sparse_layers, mixtral.moe.renormalize) == ((0, 1), True)


@pytest.mark.parametrize("name, num_params, num_active", [("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                           ("mixtral-8x7b", 46.7e9, 12.9e9)])
def test_bundled_configs_have_their_models_sizes(name, num_params, num_active):
    """The published sizes: all params, and those one token reads (top_k of the experts)."""
    config = EngineArgs(model=name, load_format="dummy").create_config().model.arch
    _, params = abstract_params(config, jnp.bfloat16)
    sizes = {path: int(np.prod(var.shape)) for path, var in params.items()}
    experts = sum(size for path, size in sizes.items() if "experts" in path)
    assert sum(sizes.values()) == pytest.approx(num_params, rel=0.01)
    active = sum(sizes.values()) - experts * (1 - config.moe.top_k / config.moe.num_experts)
    assert active == pytest.approx(num_active, rel=0.02)


def test_route_takes_the_most_probable_experts_renormalized_where_the_model_asks():
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.15, 0.25]]))
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 3]]
    np.testing.assert_allclose(weights, [[0.5, 0.25]], rtol=1e-6)
    weights, _ = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(weights, [[2 / 3, 1 / 3]], rtol=1e-6)


@pytest.mark.parametrize("args, message", [
    (dict(model=tiny_model("llama"), enable_expert_parallel=True),
     r"models \(Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2 and V3, Granite 4.0-H with experts\); this llama model"),
    (dict(model=tiny_model("qwen3_moe"), batch_invariant=True), "batch_invariant"),
])
def test_engine_args_the_experts_cannot_take_are_a_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args).create_config()


# -- the layer over several devices ------------------------------------------------------

NUM_EXPERTS, TOP_K, HIDDEN, INTER, NUM_TOKENS = 8, 2, 16, 8, 13  # 13 tokens: not a multiple of the devices


def reference_moe(x, weights, ids, gate_up, down):
    """Each token's experts one by one, in float64: x [T, H], weights, ids [T, k] -> [T, H]."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(np.asarray(weights[t]), np.asarray(ids[t])):
            g, u = np.einsum("h,hci->ci", x[t], gate_up[e])
            out[t] += w * ((g / (1 + np.exp(-g))) * u) @ down[e]
    return out


def moe_inputs(routing: str):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (NUM_TOKENS, HIDDEN), jnp.float32)
    gate_up = jax.random.normal(keys[1], (NUM_EXPERTS, HIDDEN, 2, INTER), jnp.float32) / 4
    down = jax.random.normal(keys[2], (NUM_EXPERTS, INTER, HIDDEN), jnp.float32) / 4
    logits = jax.random.normal(keys[3], (NUM_TOKENS, NUM_EXPERTS), jnp.float32)
    if routing != "random":  # the worst imbalance: every token takes expert 0 (and 1, on the same device up to 4)
        logits = jnp.zeros_like(logits).at[:, :2].set(jnp.array([2.0, 1.0]))
    weights, ids = route(logits, 1 if routing == "one_expert" else TOP_K, renormalize=True)
    return x, weights, ids, gate_up, down


@needs_8
@pytest.mark.parametrize("routing", ["random", "two_experts", "one_expert"])
@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("parallel", ["expert", "tensor"])
def test_the_moe_layer_over_devices_equals_each_tokens_experts_one_by_one(parallel, num_devices, routing):
    x, weights, ids, gate_up, down = moe_inputs(routing)
    want = reference_moe(x, weights, ids, gate_up, down)
    mesh = make_mesh(num_devices)
    axes = ("expert", "embed", None, None) if parallel == "expert" else (None, "embed", None, "mlp")
    gate_up = jax.device_put(gate_up, named_sharding(mesh, axes))
    down = jax.device_put(down, named_sharding(mesh, (axes[0], axes[3], "embed")))
    x, weights, ids = jax.device_put((x, weights, ids), replicated(mesh))
    run = moe_expert_parallel if parallel == "expert" else moe_tensor_parallel
    got = jax.jit(lambda *a: run(mesh, *a))(x, weights, ids, gate_up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if num_devices == 1:
        np.testing.assert_allclose(moe_one_device(x, weights, ids, gate_up, down), want, rtol=1e-5, atol=1e-5)


@needs_8
@pytest.mark.parametrize("parallel", ["expert", "tensor"])
def test_the_fp8_moe_layer_over_devices_is_the_layer_within_e4m3s_error(parallel):
    """quantization="fp8": the experts in e4m3 with a scale per expert and output channel, each row in
    e4m3 with its own scale. Within e4m3's error of the float64 layer (3 mantissa bits: about 4% from
    the weights' rounding and 4% from the rows'); split over 4 devices, whole experts on each, or a
    slice of every expert's intermediate on each (its rows scaled by the whole row's max), give one
    device's values (the same rows, the same scales)."""
    x, weights, ids, gate_up, down = moe_inputs("random")
    want = reference_moe(x, weights, ids, gate_up, down)
    gate_up8, down8 = quantize_experts(gate_up), quantize_experts(down)
    assert gate_up8[1].shape == (NUM_EXPERTS, 2, INTER) and down8[1].shape == (NUM_EXPERTS, HIDDEN)
    one = np.asarray(moe_one_device(x, weights, ids, gate_up8, down8))
    assert np.linalg.norm(one - want) / np.linalg.norm(want) < 0.1
    mesh = make_mesh(4)
    axes = ("expert", "embed", None, None) if parallel == "expert" else (None, "embed", None, "mlp")
    place = (lambda a, axes: jax.device_put(a, named_sharding(mesh, axes)))
    gate_up8 = place(gate_up8[0], axes), place(gate_up8[1], (axes[0], None, axes[3]))
    down8 = place(down8[0], (axes[0], axes[3], "embed")), place(down8[1], (axes[0], "embed"))
    run = moe_expert_parallel if parallel == "expert" else moe_tensor_parallel
    got = np.asarray(jax.jit(lambda *a: run(mesh, *a))(x, weights, ids, gate_up8, down8))
    np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-5)


def test_the_layer_over_eight_forced_devices():
    """The tests above, in a child process with 8 forced host devices."""
    if jax.device_count() >= 8:
        pytest.skip("this process has the devices: the tests above run here")
    run_with_host_devices(__file__, "moe_layer_over_devices", 8, "26 passed", timeout_s=600)
