"""Pipeline parallelism over 2 and 4 stages, each stage tensor parallel over 1 or 2 devices: the
same tokens and logprobs as one device, each stage's layers and KV arrays on its own devices, one
step per stage in flight with no request in two of them, nothing lost under chunked prefill,
preemption and prefix caching, nothing compiled after warm-up, and a killed core an EngineDeadError.
Dual-batch overlap (enable_dbo), with and without stages, gives one device's outputs too (and under
expert parallelism, the routed experts and outputs of whole steps), and so do
MoE (with their routed experts), latent-attention and Mamba models, FP8, n-gram speculation, params
in memory and weight updates under stages.
The tests need 8 devices; in a process with fewer, the last test runs them in a child with 8 forced
host devices."""
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

pytestmark = pytest.mark.timeout(900)

from jaxllm import LLM, EngineArgs, LLMEngine, SamplingParams
from jaxllm.sharding import PP_LAYER_PARTITION_ENV, layer_partition
from jaxllm.device_facts import DeviceFacts
from tests.conftest import (child_pids, engines_warmed_up, kill_core_and_expect_engine_dead, run_with_host_devices,
                            tiny_model)
from tests.engine.test_tensor_parallel import assert_same_outputs, write_model

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")
# 8 blocks of 16 tokens: the in-flight workload below outgrows them, so requests are preempted. One token
# bucket (16): a 22-token prompt is prefilled in two chunks.
ARGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=8,
            skip_tokenizer_init=True, enable_multiprocessing=False)
ENGINE = dict(ARGS, show_progress=False)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 8]}, {"prompt_token_ids": list(range(30, 52))}]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=4)
EIGHT_DEVICES = DeviceFacts("cpu", 8, "reference")
# 8 requests of 3 to 38 prompt tokens (prefilled in chunks, straddling the middle of the token axis), greedy
# and one seeded sample: with 4 in flight at most and 8 blocks, some are preempted.
WORKLOAD = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(3 + 5 * i)]} for i in range(8)]
WORKLOAD_PARAMS = ([SamplingParams(max_tokens=12 + i, temperature=0, ignore_eos=True) for i in range(7)]
                   + [SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)])


def outputs(llm, prompts=PROMPTS, params=PARAMS):
    return outputs_of(llm.generate(prompts, params, use_tqdm=False))


def outputs_of(outs):
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[[lp[t].logprob for t in sorted(lp)] for lp in o.outputs[0].logprobs or []] for o in outs]
    return tokens, logprobs


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A random Llama of 4 layers (one per stage at 4 stages), 8 q heads over 2 KV heads."""
    return write_model(tmp_path_factory.mktemp("four_layers"), layers=4)


@pytest.fixture(scope="module")
def one_device(four_layers):
    with engines_warmed_up():  # it runs inside the checks that nothing compiles
        llm = LLM(four_layers, **ENGINE)
    with llm:
        yield llm


@pytest.fixture(scope="module")
def pp4_tp2(four_layers):
    """Every device: 4 stages of one layer, each tensor parallel over 2 devices."""
    with engines_warmed_up():  # the steps in flight compile nothing
        llm = LLM(four_layers, pipeline_parallel_size=4, tensor_parallel_size=2, **ENGINE)
    with llm:
        yield llm


@needs_8
def test_pipeline_parallel_gives_one_devices_tokens_and_logprobs(four_layers, one_device, pp4_tp2):
    want = outputs(one_device)
    for pp, tp in ((2, 1), (2, 2), (4, 1)):
        with LLM(four_layers, pipeline_parallel_size=pp, tensor_parallel_size=tp, **ENGINE) as llm:
            assert_same_outputs(outputs(llm), want, f"pp={pp}, tp={tp}")
    assert_same_outputs(outputs(pp4_tp2), want, "pp=4, tp=2")


@needs_8
@pytest.mark.parametrize("model, pp, tp", [("deepseek_v2", 3, 1), ("granite_hybrid", 2, 2)])
def test_moe_latent_and_mamba_models_under_pipeline_parallelism_give_one_devices_outputs(model, pp, tp):
    """Each layer's experts run on its stage's devices; the stages hand on their layers' expert ids, so
    the routed experts are one device's (DeepSeek's first stage: its one dense layer, none). Granite 4.0-H
    has attention, Mamba and MoE layers, each stage tensor parallel."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, return_routed_experts=True)

    def run(pp, tp):
        with LLM(tiny_model(model), pipeline_parallel_size=pp, tensor_parallel_size=tp, **ENGINE) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            return outputs_of(outs), [np.asarray(o.outputs[0].routed_experts) for o in outs]

    (got, got_routed), (want, want_routed) = run(pp, tp), run(1, 1)
    assert_same_outputs(got, want, f"{model}, pp={pp}, tp={tp}")
    for g, w in zip(got_routed, want_routed):
        np.testing.assert_array_equal(g, w)
        assert g.shape[0] == 6  # a token's experts at each of the 6


@needs_8
def test_ngram_speculation_under_pipeline_parallelism_gives_one_devices_greedy_tokens():
    """The host proposes each request's drafts once its last token has landed (a pipeline's steps read no
    token on the device); the last stage verifies them. The tiny Llama repeats itself: drafts pass."""
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 8] * 4}, {"prompt_token_ids": list(range(30, 52)) * 2}]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with LLM(tiny_model("llama"), **ENGINE) as llm:
        want = outputs(llm, prompts, params)[0]
    with LLM(tiny_model("llama"), pipeline_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
        assert outputs(llm, prompts, params)[0] == want
        assert llm.llm_engine.engine_core.core.scheduler.spec_totals.num_accepted_tokens > 0


@needs_8
def test_params_in_memory_and_weight_updates_under_pipeline_parallelism(four_layers, one_device):
    """params= by HF names, then update_weights from memory and from the checkpoint: each stage takes its
    layers' params on its devices, and nothing compiles."""
    hf = load_file(os.path.join(four_layers, "model.safetensors"))
    new = {name: (value * 1.05).astype(value.dtype) for name, value in hf.items()}
    with LLM(four_layers, params=new, **ENGINE) as fresh:
        want_new = outputs(fresh)[0]
    with engines_warmed_up(), LLM(four_layers, pipeline_parallel_size=2, tensor_parallel_size=2, params=hf,
                                  **ENGINE) as llm:
        want = outputs(one_device)[0]
        assert outputs(llm)[0] == want
        compilations = llm.llm_engine.get_stats()["num_compilations"]
        llm.update_weights(new)
        assert outputs(llm)[0] == want_new
        llm.update_weights(four_layers)
        assert outputs(llm)[0] == want
        assert llm.llm_engine.get_stats()["num_compilations"] == compilations


@needs_8
def test_fp8_under_pipeline_parallelism_quantizes_each_stages_weights_on_its_devices(four_layers):
    """quantization="fp8" on load: each layer's e4m3 kernels and scales on its stage's devices, and the
    tokens and logprobs of one device's FP8 engine."""
    fp8 = dict(ENGINE, quantization="fp8")
    with LLM(four_layers, **fp8) as llm:
        want = outputs(llm)
    with LLM(four_layers, pipeline_parallel_size=2, tensor_parallel_size=2, **fp8) as llm:
        assert_same_outputs(outputs(llm), want, "fp8, pp=2, tp=2")
        runner = llm.llm_engine.engine_core.core.executor.runner
        stage_devices = [{d.id for d in mesh.devices.flat} for mesh in runner.stage_meshes.meshes]
        quantized = 0
        for path, value in zip(runner.weights.paths, runner.weights.params):
            if path[0] == "layers":
                assert {d.id for d in value.sharding.device_set} == stage_devices[path[1] // 2], path
                quantized += path[-1] == "weight_scale"
        assert quantized == 4 * 4  # qkv, o, gate_up and down of each layer


@needs_8
def test_each_stage_holds_its_layers_params_and_kv_arrays_on_devices_of_its_own(pp4_tp2):
    runner = pp4_tp2.llm_engine.engine_core.core.executor.runner
    meshes = runner.stage_meshes.meshes
    stage_devices = [{d.id for d in mesh.devices.flat} for mesh in meshes]
    assert stage_devices == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    for path, value in zip(runner.weights.paths, runner.weights.params):
        stage = path[1] if path[0] == "layers" else 0 if path[0] == "embed_tokens" else 3
        assert {d.id for d in value.sharding.device_set} == stage_devices[stage], path
    assert runner.mesh == meshes[-1]  # the sampling's
    for stage, part in enumerate(runner.kv_cache.stages):
        assert part.tensors == (stage,)  # layer i writes KV tensor i
        for cache in runner.kv_caches[part.slice]:
            for array in cache:
                assert {d.id for d in array.sharding.device_set} == stage_devices[stage]
                assert {s.data.shape[2] for s in array.addressable_shards} == {1}  # 2 KV heads over 2 devices


@needs_8
def test_steps_in_flight_hold_other_requests_and_lose_no_output(one_device, pp4_tp2):
    """Four steps in flight, a request in one of them at most; chunked prompts, preemptions (8 blocks for
    8 requests of up to 4), a seeded sampled request and a prefix-cache hit: every request gets every
    token, as on one device, and nothing compiles."""
    prompts, params = WORKLOAD, WORKLOAD_PARAMS
    core = pp4_tp2.llm_engine.engine_core.core
    in_flight = []  # before each wait for the oldest step: the sampling requests of every step in flight
    apply_oldest = core._apply_oldest

    def recording_apply_oldest():
        in_flight.append([{s.req_id for s in sched.scheduled if s.samples} for sched, _ in core.batch_queue])
        return apply_oldest()

    before = pp4_tp2.llm_engine.get_stats()
    core._apply_oldest = recording_apply_oldest
    try:
        got = outputs(pp4_tp2, prompts, params)
    finally:
        del core._apply_oldest
    assert got == outputs(one_device, prompts, params)
    assert [len(t) for t in got[0]] == [p.max_tokens for p in params]
    assert max(len(steps) for steps in in_flight) == 4
    for steps in in_flight:
        ids = [i for step_ids in steps for i in step_ids]
        assert len(ids) == len(set(ids)), steps
    shared = {"prompt_token_ids": prompts[7]["prompt_token_ids"][:32] + [9, 9]}
    assert outputs(pp4_tp2, [shared])[0] == outputs(one_device, [shared])[0]
    after = pp4_tp2.llm_engine.get_stats()
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["prefix_cache_hits"] >= before["prefix_cache_hits"] + 32
    assert after["num_compilations"] == before["num_compilations"]


@needs_8
@pytest.mark.usefixtures("warm_up")
def test_dual_batch_overlap_gives_one_devices_outputs_and_compiles_nothing_after_warm_up(four_layers, one_device):
    """enable_dbo over 2 tensor-parallel devices, alone and in each of 2 pipeline stages, against one device
    running each step in one piece."""
    want, want_workload = outputs(one_device), outputs(one_device, WORKLOAD, WORKLOAD_PARAMS)[0]
    for pp in (1, 2):
        with LLM(four_layers, pipeline_parallel_size=pp, tensor_parallel_size=2, enable_dbo=True, **ENGINE) as llm:
            before = llm.llm_engine.get_stats()["num_compilations"]
            assert_same_outputs(outputs(llm), want, f"dbo, pp={pp}")
            assert outputs(llm, WORKLOAD, WORKLOAD_PARAMS)[0] == want_workload, f"dbo, pp={pp}"
            assert llm.llm_engine.get_stats()["num_compilations"] == before


@needs_8
def test_dual_batch_overlap_under_expert_parallelism_gives_the_whole_steps_outputs():
    """Qwen3-MoE's experts whole on each of 2 devices (each half's all-to-alls free to overlap the other
    half's compute) with enable_dbo and without: the same tokens and routed experts, logprobs within float
    rounding (the 22-token prompt straddles the middle of the 16-token bucket)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, return_routed_experts=True)

    def run(dbo):
        with LLM(tiny_model("qwen3_moe"), tensor_parallel_size=2, enable_expert_parallel=True, enable_dbo=dbo,
                 **ENGINE) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            return outputs_of(outs), [o.outputs[0].routed_experts for o in outs]

    (got, got_routed), (want, want_routed) = run(True), run(False)
    assert_same_outputs(got, want, "qwen3_moe, expert parallel over 2, dbo")
    for g, w in zip(got_routed, want_routed):
        np.testing.assert_array_equal(g, w)


@needs_8
def test_killing_a_pipeline_parallel_core_raises_engine_dead_error(four_layers):
    args = EngineArgs(model=four_layers, pipeline_parallel_size=2, **{**ARGS, "enable_multiprocessing": True})
    engine = LLMEngine.from_engine_args(args, show_progress=False)
    try:
        for i in range(4):
            engine.add_request(f"r{i}", {"prompt_token_ids": [3 + i, 4, 5]}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        kill_core_and_expect_engine_dead(engine)
    finally:
        engine.shutdown()
    assert child_pids() == []


def test_layers_split_as_vllm_splits_them():
    assert layer_partition(10, 4) == (2, 3, 3, 2)  # the extra layers before the last stage, which holds the head
    assert layer_partition(4, 4) == (1, 1, 1, 1)
    assert layer_partition(7, 2) == (4, 3)


def test_a_layer_partition_from_the_environment(monkeypatch, four_layers):
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,3")
    config = EngineArgs(model=four_layers, pipeline_parallel_size=2).create_config(EIGHT_DEVICES)
    assert config.parallel.layer_partition == (1, 3)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "2,3")
    with pytest.raises(ValueError, match="adding up to the model's 4 layers"):
        EngineArgs(model=four_layers, pipeline_parallel_size=2).create_config(EIGHT_DEVICES)


@pytest.mark.parametrize("model, kwargs, message", [
    ("llama", dict(speculative_config={"method": "draft_model", "model": tiny_model("llama"),
                                       "num_speculative_tokens": 2}), "speculative_config method 'draft_model'"),
])
def test_what_pipeline_parallelism_does_not_run_with_is_a_clear_error(model, kwargs, message):
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 does not run with {message}"):
        EngineArgs(model=tiny_model(model), pipeline_parallel_size=2, **kwargs).create_config(EIGHT_DEVICES)


def test_dual_batch_overlap_with_speculative_decoding_is_a_clear_error():
    with pytest.raises(ValueError, match="enable_dbo does not run with speculative_config yet"):
        EngineArgs(model=tiny_model("llama"), enable_dbo=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_config(EIGHT_DEVICES)


def test_more_stages_than_layers_or_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        EngineArgs(model=tiny_model("llama"), pipeline_parallel_size=3).create_config(EIGHT_DEVICES)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 x tensor_parallel_size=2 exceeds the 2"):
        EngineArgs(model=tiny_model("llama"), pipeline_parallel_size=2, tensor_parallel_size=2).create_config(
            DeviceFacts("cpu", 2, "reference"))


def test_pipeline_parallel_over_eight_forced_devices():
    """The tests above that need 8 devices, in a child process with 8 forced host devices."""
    if jax.device_count() >= 8:
        pytest.skip("this process has the devices: the tests above run here")
    run_with_host_devices(__file__, "not eight_forced and not clear_error and not vllm_splits and not environment",
                          8, "11 passed", timeout_s=900)
