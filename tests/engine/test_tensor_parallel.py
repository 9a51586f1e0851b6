"""Tensor parallelism over 2, 4 and 8 devices, KV heads replicated where the devices
outnumber them: the same greedy tokens and logprobs as one device (FP8 over 8 too), and every array
placed by the sharding rules. The tests need 8 devices; in a process with fewer, the
last test runs them in a child with 8 forced host devices."""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.sharding import kv_cache_sharding, named_sharding
from tests.conftest import run_with_host_devices, tiny_model

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, skip_tokenizer_init=True,
              show_progress=False, enable_multiprocessing=False)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 8]}, {"prompt_token_ids": list(range(30, 52))}]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=4)


def write_model(folder, num_heads=8, num_kv_heads=2, head_dim=8, hidden=64, layers=2, vocab=256, seed=0) -> str:
    """A random Llama HF folder with `num_heads` q heads over `num_kv_heads` KV heads."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": num_heads,
              "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (2 * hidden, hidden), p + "mlp.up_proj.weight": (2 * hidden, hidden),
                       p + "mlp.down_proj.weight": (hidden, 2 * hidden), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    tensors = {name: (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                      else 0.1 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("eight_heads"))


def outputs(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[[lp[t].logprob for t in sorted(lp)] for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


def run(model, tp, **overrides):
    with LLM(model, tensor_parallel_size=tp, **{**ENGINE, **overrides}) as llm:
        return outputs(llm)


def assert_same_outputs(got, want, what):
    assert got[0] == want[0], what
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def eight_heads_tp8(eight_heads):
    """8 q heads over 2 KV heads on 8 devices: each KV head repeated to 4 devices."""
    with LLM(eight_heads, tensor_parallel_size=8, **ENGINE) as llm:
        yield llm


@needs_8
def test_tensor_parallel_gives_one_devices_tokens_and_logprobs(eight_heads, eight_heads_tp8):
    """2 KV heads over 2 devices (one each) and over 4 (each repeated), and 2 over 8."""
    want = run(tiny_model("llama"), 1)
    for tp in (2, 4):
        assert_same_outputs(run(tiny_model("llama"), tp), want, f"tp={tp}")
    assert_same_outputs(outputs(eight_heads_tp8), run(eight_heads, 1), "8 heads, tp=8")


@needs_8
def test_fp8_under_tensor_parallelism_gives_one_devices_tokens_and_logprobs(eight_heads):
    """quantization="fp8" over 8 devices (KV heads repeated): each device quantizes its own
    shard of the activations with the token's global max, so the products are one device's."""
    assert_same_outputs(run(eight_heads, 8, quantization="fp8"), run(eight_heads, 1, quantization="fp8"), "fp8")


@needs_8
def test_every_array_is_placed_by_the_rules_and_no_device_holds_a_sharded_weight_whole(eight_heads_tp8):
    runner = eight_heads_tp8.llm_engine.engine_core.core.executor.runner
    model = runner.weights.model()
    sharded = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value, axes = var.get_value(), var.get_metadata()["out_sharding"]
        assert value.sharding == named_sharding(runner.mesh, axes), path
        if any(s is not None for s in value.sharding.spec):
            sharded += 1
            assert all(s.data.shape != value.shape for s in value.addressable_shards), path
    assert sharded == 2 * 4 + 2  # qkv, o, gate_up, down of both layers; embedding and head
    # 2 KV heads repeated to 8: one per device, in the cache as in qkv_proj, whose shard
    # is a group of one q head, its k head and its v head (head_dim 8).
    assert runner.arch.num_kv_heads == 8
    qkv = model.layers[0].self_attn.qkv_proj.kernel.get_value()
    assert {s.data.shape for s in qkv.addressable_shards} == {(64, 3 * 8)}
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            assert cache.sharding == kv_cache_sharding(runner.mesh)
            assert {s.data.shape[2] for s in cache.addressable_shards} == {1}


@needs_8
def test_a_mamba_hybrid_under_tensor_parallelism_gives_one_devices_tokens_and_logprobs():
    """Granite 4.0-H (Mamba2 layers of 8 heads in 2 groups, attention and experts) over 2 devices: each
    device runs whole heads, its share of the states on it."""
    want = run(tiny_model("granite_hybrid"), 1)
    with LLM(tiny_model("granite_hybrid"), tensor_parallel_size=2, **ENGINE) as llm:
        assert_same_outputs(outputs(llm), want, "tp=2")
        conv_x, conv_bc, ssm = llm.llm_engine.engine_core.core.executor.runner.kv_caches[-1]
        assert {s.data.shape[2] for s in conv_x.addressable_shards} == {32}  # x's 64 channels
        assert {s.data.shape for s in conv_bc.addressable_shards} == {conv_bc.shape}  # B and C: whole
        assert {s.data.shape[1] for s in ssm.addressable_shards} == {4}  # 8 heads


@needs_8
def test_the_memory_budget_counts_a_devices_share_of_the_split_caches(monkeypatch):
    """Sized from a device's free memory, the cache of 2 devices holds twice the blocks of one: each
    holds half of every block's KV heads."""
    from jaxllm.config import EngineArgs
    from jaxllm.models.kv_layout import model_kv_layout
    from jaxllm.sharding import make_mesh
    from jaxllm.worker import kv_cache

    class Card:
        process_index = 0

        def memory_stats(self):
            return {"bytes_limit": 2**30, "bytes_in_use": 0}

    configs = {tp: EngineArgs(model=tiny_model("llama"), tensor_parallel_size=tp, max_model_len=64,
                              max_num_seqs=4).create_config() for tp in (1, 2)}
    monkeypatch.setattr(kv_cache.jax, "local_devices", lambda: [Card()])  # where the budget reads the memory
    blocks = {}
    for tp, config in configs.items():
        arch = config.model.arch
        cache = kv_cache.KVCache(config, arch, model_kv_layout(arch), make_mesh(tp))
        free = 2**30 * config.cache.gpu_memory_utilization - cache.step_reserve - cache._processor_state_bytes()
        blocks[tp] = cache.num_blocks
        assert blocks[tp] == int(free // (cache.bytes_per_block // tp))
    assert blocks[2] >= 2 * blocks[1] - 1


@needs_8
def test_heads_that_do_not_split_over_the_devices_are_a_clear_error():
    from jaxllm.config import EngineArgs
    with pytest.raises(ValueError, match="tensor_parallel_size=8 must divide the model's attention heads"):
        EngineArgs(model=tiny_model("llama"), tensor_parallel_size=8).create_config()  # 4 q heads


def test_an_mlp_or_a_vocabulary_that_does_not_split_over_the_devices_is_a_clear_error(tmp_path):
    from jaxllm.config import EngineArgs
    from jaxllm.device_facts import DeviceFacts
    four = DeviceFacts("cpu", 4, "reference")
    model = write_model(tmp_path, num_heads=4, num_kv_heads=4, vocab=258)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's vocab_size \(258\)"):
        EngineArgs(model=model, tensor_parallel_size=4).create_config(four)
    EngineArgs(model=model, tensor_parallel_size=2).create_config(four)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({**config, "vocab_size": 256, "intermediate_size": 130}, f)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's intermediate_size \(130\)"):
        EngineArgs(model=model, tensor_parallel_size=4).create_config(four)


def test_mamba_heads_that_do_not_split_over_the_devices_are_a_clear_error(tmp_path):
    from jaxllm.config import EngineArgs
    from jaxllm.device_facts import DeviceFacts
    with open(os.path.join(tiny_model("mamba2"), "config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "num_heads": 6, "hidden_size": 24}, f)  # in 2 groups, 6 * 8 = 2 * 24
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's Mamba heads \(6\)"):
        EngineArgs(model=str(tmp_path), load_format="dummy", tensor_parallel_size=4).create_config(
            DeviceFacts("cpu", 4, "reference"))


def test_tensor_parallel_over_eight_forced_devices():
    """The tests above, in a child process with 8 forced host devices."""
    if jax.device_count() >= 8:
        pytest.skip("this process has the devices: the tests above run here")
    run_with_host_devices(__file__, "not eight_forced and not vocabulary and not mamba_heads", 8, "6 passed",
                          timeout_s=900)
