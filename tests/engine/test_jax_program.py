"""The engine inside a JAX program: params and mesh handed over in memory (the engine's layout
and HF names), weights updated without a restart or a recompilation, generation paused and
resumed around an update, memory freed and regained between rollouts, and, with
batch_invariant=True, numbers that do not depend on the batch and equal the plain forward's.
The mesh tests need 8 devices; in a process with fewer, the last test runs them in a child."""
import asyncio
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxllm import LLM, AsyncLLM, LLMEngine, SamplingParams
from jaxllm import compilation
from jaxllm.config import EngineArgs
from jaxllm.models.orbax_checkpoint import save_model
from tests.conftest import engines_warmed_up, run_with_host_devices, tiny_model
from tests.engine.test_tensor_parallel import write_model

pytestmark = pytest.mark.timeout(600)
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")
ENGINE = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=128,
              num_gpu_blocks_override=64, show_progress=False, enable_multiprocessing=False)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(30, 60))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)


def tokens(llm, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_params(model: str) -> dict[str, np.ndarray]:
    """A checkpoint's tensors by HF name, as a trainer holding an HF-named pytree would."""
    return load_file(os.path.join(model, "model.safetensors"))


def perturbed(params, scale=1.05):
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), params)


@pytest.fixture(scope="module")
def llm():
    with engines_warmed_up():  # an update compiles nothing: every executable was compiled before it
        llm = LLM(tiny_model("llama"), **ENGINE)
    with llm:
        yield llm


@pytest.fixture(scope="module")
def disk_tokens(llm):
    return tokens(llm), tokens(llm, SEEDED)


# -- 1. params in memory -----------------------------------------------------------------

@pytest.mark.parametrize("on_one_device", [False, True])
@pytest.mark.parametrize("layout", ["engine", "hf"])
def test_params_in_memory_give_the_tokens_of_the_weights_on_disk(llm, disk_tokens, layout, on_one_device):
    """on_one_device: with a mesh= of one device, the last (not device 0 where the process has several)."""
    params = llm.get_params() if layout == "engine" else hf_params(tiny_model("llama"))
    device = jax.devices()[-1]
    mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("fsdp", "tp")) if on_one_device else None
    with LLM(tiny_model("llama"), params=params, mesh=mesh, **ENGINE) as mem:
        assert (tokens(mem), tokens(mem, SEEDED)) == disk_tokens
        if on_one_device:
            runner = mem.llm_engine.engine_core.core.executor.runner
            assert all(a.sharding.device_set == {device} for a in runner.weights.params)


@pytest.mark.parametrize("name", ["mamba2", "granite_hybrid"])
def test_a_mamba_models_params_by_hf_names_give_the_tokens_of_its_weights_on_disk(name):
    """A Mamba mixer's HF in_proj and conv1d are each two params (rows of them: models/loader.py), and
    Granite 4.0-H's input_linear holds gate's rows then up's, of its stacked experts and its shared MLP."""
    with LLM(tiny_model(name), **ENGINE) as disk:
        with LLM(tiny_model(name), params=hf_params(tiny_model(name)), **ENGINE) as mem:
            assert tokens(mem) == tokens(disk)


# The mesh tests' engines: one token budget of 32 (two buckets to compile), all on one 2x2 mesh of
# devices 2-5, so that after the first engine every other one finds its executables compiled.
MESH_ENGINE = {**ENGINE, "max_num_batched_tokens": 32}


def mesh_of_four() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[2:6]).reshape(2, 2), ("fsdp", "tp"))


@needs_8
@pytest.mark.parametrize("layout", ["engine", "hf"])
def test_mesh_params_on_a_2x2_mesh_cut_from_8_devices_give_one_devices_tokens(tmp_path, layout):
    model = write_model(tmp_path)  # 8 q heads over 2 KV heads: 4 devices repeat each KV head twice
    with LLM(model, **MESH_ENGINE) as one:
        want = tokens(one)
    mesh = mesh_of_four()
    params = hf_params(model) if layout == "hf" else None
    if layout == "engine":  # a tensor-parallel engine's own layout: its KV heads repeated
        with LLM(model, mesh=mesh, **MESH_ENGINE) as probe:
            params = jax.device_get(probe.get_params())
    with LLM(model, params=params, mesh=mesh, **MESH_ENGINE) as llm:
        assert tokens(llm) == want
        runner = llm.llm_engine.engine_core.core.executor.runner
        assert {d.id for d in runner.mesh.devices.flat} == {2, 3, 4, 5}
        assert all(set(a.sharding.device_set) == set(runner.mesh.devices.flat) for a in runner.weights.params)


# -- 2. update_weights ---------------------------------------------------------------------

def test_an_update_gives_a_fresh_engines_outputs_compiles_nothing_and_frees_the_old_weights(llm):
    new = perturbed(llm.get_params())
    with LLM(tiny_model("llama"), params=new, **ENGINE) as fresh:
        want = tokens(fresh), tokens(fresh, SEEDED)
    runner = llm.llm_engine.engine_core.core.executor.runner
    llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)  # its prompt's blocks in the prefix cache
    old = list(runner.weights.params)
    before = compilation.num_compilations()
    llm.update_weights(new)
    hits = llm.llm_engine.prefix_cache_stats()[1]
    llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert llm.llm_engine.prefix_cache_stats()[1] == hits  # the old prompt misses: its KV was the old weights'
    assert (tokens(llm), tokens(llm, SEEDED)) == want
    assert compilation.num_compilations() == before
    assert all(a.is_deleted() for a in old)
    llm.update_weights(hf_params(tiny_model("llama")))  # and back, from HF names
    assert compilation.num_compilations() == before


def test_an_update_from_a_checkpoint_path_reads_its_weights(llm, disk_tokens, tmp_path):
    llm.update_weights(perturbed(llm.get_params(), 0.9))
    llm.update_weights(tiny_model("llama"))
    assert (tokens(llm), tokens(llm, SEEDED)) == disk_tokens


def save_orbax(llm, folder, change=lambda path, param: param) -> str:
    """`llm`'s model, each param replaced by change(path, param), saved as an orbax checkpoint's
    folder (its params beside the tiny Llama's config files, as `jaxllm convert` writes them)."""
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny_model("llama"), name), folder)
    weights = llm.llm_engine.engine_core.core.executor.runner.weights
    save_model(weights.model([change(path, p) for path, p in zip(weights.paths, weights.params)]), str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def changed_orbax(llm, tmp_path_factory):
    """An orbax checkpoint of the tiny Llama with every param scaled by 1.05, and the tokens (greedy,
    seeded) of an engine built from it."""
    folder = save_orbax(llm, tmp_path_factory.mktemp("changed"), lambda path, p: (p * 1.05).astype(p.dtype))
    with LLM(folder, **ENGINE) as fresh:
        return folder, (tokens(fresh), tokens(fresh, SEEDED))


def test_an_update_from_an_orbax_checkpoint_gives_the_tokens_of_an_engine_built_from_it(llm, disk_tokens,
                                                                                       changed_orbax):
    folder, want = changed_orbax
    before = compilation.num_compilations()
    llm.update_weights(folder)
    got, compiled = (tokens(llm), tokens(llm, SEEDED)), compilation.num_compilations() - before
    llm.update_weights(tiny_model("llama"))
    assert got == want != disk_tokens and compiled == 0


def test_a_mismatched_orbax_checkpoint_raises_naming_the_param_and_changes_nothing(llm, disk_tokens, tmp_path):
    # Every other param doubled: had any of them been taken, the tokens would change.
    folder = save_orbax(llm, tmp_path, lambda path, p: p[:3] if path == ("norm", "weight") else p * 2)
    with pytest.raises(ValueError, match="wrong shape: norm\\.weight \\(3,\\) \\(the model's: \\(64,\\)\\)"):
        llm.update_weights(folder)
    assert tokens(llm) == disk_tokens[0]


@pytest.mark.parametrize("bad, message", [
    ("missing", "missing \\['lm_head.kernel'\\]"),
    ("extra", "unexpected \\['extra.kernel'\\]"),
    ("shape", "param norm.weight has shape \\(3,\\), expected \\(64,\\)"),
    ("dtype", "param norm.weight has dtype bfloat16, expected float32"),
    ("hf name", "unexpected \\['model.layers.0.self_attn.qq_proj.weight'\\]"),
])
def test_bad_params_raise_naming_the_param_and_the_engine_keeps_its_weights(llm, disk_tokens, bad, message):
    params = llm.get_params() if bad != "hf name" else hf_params(tiny_model("llama"))
    params = jax.tree.map(lambda x: x, params)  # a copy of the structure
    if bad == "missing":
        del params["lm_head"]
    elif bad == "extra":
        params["extra"] = {"kernel": jnp.zeros((2, 2))}
    elif bad == "shape":
        params["norm"]["weight"] = jnp.ones((3,))
    elif bad == "dtype":
        params["norm"]["weight"] = params["norm"]["weight"].astype(jnp.bfloat16)
    else:
        params["model.layers.0.self_attn.qq_proj.weight"] = params.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=message):
        llm.update_weights(params)
    assert tokens(llm) == disk_tokens[0]


@needs_8
def test_params_on_devices_outside_the_mesh_raise_and_change_nothing(tmp_path):
    with LLM(write_model(tmp_path), mesh=mesh_of_four(), **MESH_ENGINE) as llm:
        want = tokens(llm)
        params = jax.device_put(jax.device_get(llm.get_params()), jax.devices()[7])
        with pytest.raises(ValueError, match="lives on devices outside the engine's mesh \\(\\[7\\]\\)"):
            llm.update_weights(params)
        assert tokens(llm) == want


def test_an_update_while_requests_run_unpaused_is_refused(llm):
    engine = llm.llm_engine
    engine.add_request("running", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="update_weights while requests run: pause_generation\\(\\) first"):
        engine.update_weights(llm.get_params())
    engine.abort_request("running")
    while engine.has_unfinished_requests():
        engine.step()


# -- 3. pause / update / resume ---------------------------------------------------------------

@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_pause_update_resume_with_requests_in_flight(mode):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), **{
        k: v for k, v in ENGINE.items() if k != "show_progress"}), show_progress=False)
    try:
        old = jax.device_get(engine.get_params())  # a copy: the update deletes the engine's arrays
        new = perturbed(old)
        long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, long)
        got = {f"r{i}": [] for i in range(len(PROMPTS))}
        finish = {}

        def step():
            for out in engine.step():
                got[out.request_id] += out.outputs[0].token_ids if out.finished else []
                if out.finished:
                    finish[out.request_id] = out.outputs[0].finish_reason

        for _ in range(4):
            step()
        engine.pause_generation(mode)
        while engine.get_stats()["num_running"] or (mode == "abort" and engine.has_unfinished_requests()):
            step()
        # Paused: nothing runs; requests added now wait.
        engine.add_request("late", PROMPTS[0], GREEDY)
        got["late"] = []
        engine.update_weights(new)
        engine.resume_generation()
        while engine.has_unfinished_requests():
            step()
        stats = engine.get_stats()
        assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        with LLM(tiny_model("llama"), params=new, **ENGINE) as fresh:
            assert got["late"] == tokens(fresh, GREEDY, [PROMPTS[0]])[0] and finish["late"] == "length"
            with LLM(tiny_model("llama"), params=old, **ENGINE) as before:
                old_tokens = tokens(before, long)
            for i, p in enumerate(PROMPTS):
                out, reason = got[f"r{i}"], finish[f"r{i}"]
                if mode == "wait":  # finished before the update, on the old weights
                    assert (out, reason) == (old_tokens[i], "length")
                elif mode == "abort":
                    assert reason == "abort" and out == old_tokens[i][:len(out)] and len(out) < 12
                else:  # the tokens before the pause are the old weights', the rest the new weights' from there
                    cut = next(k for k in range(13) if k == 12 or out[k] != old_tokens[i][k])
                    resumed = {"prompt_token_ids": p["prompt_token_ids"] + out[:cut]}
                    rest = SamplingParams(temperature=0.0, max_tokens=12 - cut, ignore_eos=True)
                    assert reason == "length" and len(out) == 12
                    assert out[cut:] == tokens(fresh, rest, [resumed])[0][:12 - cut]
    finally:
        engine.shutdown()


@pytest.mark.timeout(180)
def test_async_llm_pauses_updates_from_a_path_sleeps_and_wakes_its_core_in_a_process_of_its_own(
        disk_tokens, changed_orbax):
    folder, (changed, _) = changed_orbax
    args = EngineArgs(model=tiny_model("llama"), **{k: v for k, v in ENGINE.items()
                                                      if k not in ("show_progress", "enable_multiprocessing")})

    async def final_tokens(llm, prompt, params, request_id) -> list[int]:
        async for out in llm.generate(prompt, params, request_id):
            pass
        return out.outputs[0].token_ids

    async def run(llm) -> None:
        generate = lambda name: asyncio.gather(*(final_tokens(llm, p, GREEDY, f"{name}-{i}")
                                                  for i, p in enumerate(PROMPTS)))
        running = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), "running")
        first = out = await anext(running)  # it runs
        await llm.pause_generation("wait")  # returns once it has finished, on the old weights
        async for out in running:
            pass
        assert not first.finished and out.finished and out.outputs[0].token_ids[:8] == disk_tokens[0][1]
        late = asyncio.create_task(final_tokens(llm, PROMPTS[0], GREEDY, "late"))  # waits while paused
        await llm.update_weights(folder)
        await llm.resume_generation()
        assert await late == changed[0] and await generate("updated") == changed
        await llm.sleep(1)
        assert await llm.is_sleeping()
        await llm.wake_up()
        assert not await llm.is_sleeping() and await generate("awake") == changed
        await llm.sleep(2)
        await llm.wake_up()  # the weights come back from the engine's own checkpoint
        assert await generate("reloaded") == disk_tokens[0]

    llm = AsyncLLM.from_engine_args(args, show_progress=False)
    try:
        asyncio.run(asyncio.wait_for(run(llm), 120))
    finally:
        llm.shutdown()


# -- 4. sleep / wake_up -------------------------------------------------------------------

def held_bytes() -> int:
    """Bytes of the process's live arrays (jax.live_arrays)."""
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.mark.usefixtures("warm_up")
def test_sleep_frees_the_kv_cache_then_the_weights_and_wake_up_regains_them_and_serves_as_before(disk_tokens):
    others = held_bytes()  # the other tests' engines
    with LLM(tiny_model("llama"), **ENGINE) as llm:
        runner = llm.llm_engine.engine_core.core.executor.runner
        assert tokens(llm) == disk_tokens[0]
        before, kv_bytes = held_bytes() - others, runner.num_blocks * runner.kv_cache.bytes_per_block
        compiles = compilation.num_compilations()
        llm.sleep(1)
        assert llm.is_sleeping() and held_bytes() - others <= before - 0.95 * kv_bytes
        with pytest.raises(ValueError, match="the engine is asleep: wake_up\\(\\) first"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        llm.wake_up()  # all back but small buffers a step makes when it needs them
        assert not llm.is_sleeping() and 0.99 * before <= held_bytes() - others <= before
        assert tokens(llm) == disk_tokens[0]
        llm.sleep(2)
        assert held_bytes() - others < 0.01 * before
        llm.wake_up(["weights"])
        llm.wake_up(["kv_cache"])
        assert 0.99 * before <= held_bytes() - others <= before
        assert tokens(llm) == disk_tokens[0] and compilation.num_compilations() == compiles


def test_weights_given_in_memory_come_back_from_level_2_sleep_through_update_weights(llm, disk_tokens):
    with LLM(tiny_model("llama"), params=llm.get_params(), **ENGINE) as mem:
        params = jax.device_get(mem.get_params())
        mem.sleep(2)
        with pytest.raises(ValueError, match="pass them to update_weights"):
            mem.wake_up()
        mem.update_weights(params)
        mem.wake_up(["kv_cache"])
        assert tokens(mem) == disk_tokens[0]


# -- 5. batch invariance ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def invariant():
    with LLM(tiny_model("llama"), batch_invariant=True, **{**ENGINE, "max_num_seqs": 64,
                                                           "max_num_batched_tokens": 512}) as llm:
        yield llm


def tokens_and_logprobs(out) -> tuple[list[int], list]:
    c = out.outputs[0]
    return c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]


def test_batch_invariant_outputs_are_bitwise_alone_and_among_others_at_every_position(invariant):
    """Every generated token's logprobs, alone and among k others at each of the k + 1 places of the
    batch: among 63 others in 8 batches, in each of them at every 8th place (8 copies among 56 others)."""
    rng = np.random.default_rng(0)
    target = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    alone = tokens_and_logprobs(invariant.generate(target, params, use_tqdm=False)[0])
    for k in (1, 7, 63):
        others = [{"prompt_token_ids": rng.integers(3, 256, int(rng.integers(2, 60))).tolist()} for _ in range(k)]
        stride = min(k + 1, 8)
        for first in range(stride):
            rest = iter(others)
            batch = [target if i % stride == first else next(rest) for i in range(k + 1)]
            outs = invariant.generate(batch, params, use_tqdm=False)
            for position in range(first, k + 1, stride):
                assert tokens_and_logprobs(outs[position]) == alone, (k, position)


def assert_plain_logprobs_are_the_engines_bitwise(llm, max_tokens=10):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    sequence = prompt + out.outputs[0].token_ids
    plain = np.asarray(jax.jit(llm.get_logprobs_fn())(llm.get_params(), jnp.array(sequence, jnp.int32)))
    engine = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    engine += [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    assert plain.dtype == np.float32 and plain.tolist() == engine
    return sequence


def test_batch_invariant_logprobs_equal_the_plain_forwards_bitwise(invariant):
    assert_plain_logprobs_are_the_engines_bitwise(invariant)


def test_over_the_pallas_kernel_the_plain_forward_is_the_engines_bitwise_and_differentiates_as_the_reference(
        invariant):
    """A GPU's batch-invariant engine attends through the Pallas kernel (here in its interpreter): the plain
    forward runs that kernel too, and takes the reference attention's gradient."""
    with LLM(tiny_model("llama"), batch_invariant=True, attention_backend="pallas", **ENGINE) as llm:
        sequence = jnp.array(assert_plain_logprobs_are_the_engines_bitwise(llm, max_tokens=4), jnp.int32)
        loss = lambda fn: jax.jit(jax.grad(lambda p: fn(p, sequence).sum()))
        kernel = jax.tree.leaves(loss(llm.get_logprobs_fn())(llm.get_params()))
    reference = jax.tree.leaves(loss(invariant.get_logprobs_fn())(invariant.get_params()))
    for got, want in zip(kernel, reference):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_plain_forward_is_close_to_the_engine_without_batch_invariance(llm):
    prompt = list(range(40, 70))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    plain = np.asarray(llm.get_logprobs_fn()(llm.get_params(), jnp.array(prompt, jnp.int32)))
    np.testing.assert_allclose(plain, [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])],
                               rtol=0, atol=1e-4)


def test_batch_invariant_refuses_quantization():
    with pytest.raises(ValueError, match="batch_invariant runs without quantization"):
        EngineArgs(model=tiny_model("llama"), batch_invariant=True, quantization="fp8").create_config()


# -- batch invariance under tensor parallelism (in the 8-device child) --------------------------

def assert_bitwise_alone_and_among_others(llm, places: dict[int, tuple[int, ...]], max_tokens=8):
    """A request's tokens and top-3 logprobs alone, then among k others at each of places[k]."""
    rng = np.random.default_rng(1)
    target = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    alone = tokens_and_logprobs(llm.generate(target, params, use_tqdm=False)[0])
    for k, positions in places.items():
        others = [{"prompt_token_ids": rng.integers(3, 256, int(rng.integers(2, 20))).tolist()} for _ in range(k)]
        for position in positions:
            batch = others[:position] + [target] + others[position:]
            got = tokens_and_logprobs(llm.generate(batch, params, use_tqdm=False)[position])
            assert got == alone, (k, position)
    return alone


@pytest.fixture(scope="module")
def invariant_tp2():
    with LLM(tiny_model("llama"), batch_invariant=True, tensor_parallel_size=2,
             **{**ENGINE, "max_num_seqs": 32, "max_num_batched_tokens": 256}) as llm:
        yield llm


@needs_8
def test_batch_invariant_under_tensor_parallel_2_is_bitwise_alone_and_among_7_and_31_others(invariant_tp2, invariant):
    """And the same greedy tokens as one device, its logprobs close (the partial sums' split differs)."""
    alone = assert_bitwise_alone_and_among_others(invariant_tp2, {7: (0, 3, 7), 31: (0, 16, 31)})
    target = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    one_device = tokens_and_logprobs(invariant.generate(target, params, use_tqdm=False)[0])
    assert alone[0] == one_device[0]
    for got, want in zip(alone[1], one_device[1]):
        assert [t for t, _ in got] == [t for t, _ in want]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], rtol=0, atol=1e-5)


@needs_8
def test_batch_invariant_under_tensor_parallel_2_the_plain_forward_is_the_engines_and_differentiates(
        invariant_tp2, invariant):
    """get_logprobs_fn bitwise the engine's logprobs, and its gradient close to one device's."""
    sequence = jnp.array(assert_plain_logprobs_are_the_engines_bitwise(invariant_tp2), jnp.int32)
    grad = lambda llm: jax.tree.leaves(jax.device_get(jax.jit(jax.grad(
        lambda p: llm.get_logprobs_fn()(p, sequence).sum()))(llm.get_params())))
    for got, want in zip(grad(invariant_tp2), grad(invariant)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


FLOATS = ("f16", "bf16", "f32", "f64")


def order_dependent_reductions(hlo: str) -> list[str]:
    """The cross-device reductions of compiled HLO text whose result depends on the order the collective
    adds in: an all-reduce or reduce-scatter of floats whose reduction is not max or min. Max and min
    are exact in any order, and so is a sum of integers (argmax across the vocabulary's shards, a rank's
    count); a float sum is not, and NCCL may order it by the message's size (so by the bucket)."""
    roots, name = {}, None  # computation name -> the opcode of its ROOT
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) \(.*\{$", line)  # "%region_0.1 (a: f32[], b: f32[]) -> f32[] {"
        if header:
            name = header.group(1)
        elif line.strip().startswith("ROOT ") and name is not None:  # "ROOT %add.2 = f32[] add(%a, %b)"
            roots[name] = re.search(r"= .*? ([a-z][\w-]*)\(", line).group(1)
    found = []
    for line in hlo.splitlines():
        op = next((o for o in ("all-reduce", "all-reduce-start", "reduce-scatter") if f" {o}(" in line), None)
        if op is None:
            continue
        result_type = line.split("=", 1)[1].split(f" {op}(")[0]
        reduction = roots.get(line.split("to_apply=")[1].split(",")[0].lstrip("%"))
        if any(t + "[" in result_type for t in FLOATS) and reduction not in ("maximum", "minimum"):
            found.append(line.strip()[:160])
    return found


@needs_8
def test_the_order_dependent_reduction_finder_tells_a_float_sum_from_a_max_and_an_integer_sum():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    spec = jax.sharding.PartitionSpec("model")

    def hlo(reduce, x):
        fn = jax.shard_map(lambda a: reduce(a, "model"), mesh=mesh, in_specs=spec, out_specs=spec)
        return jax.jit(fn).lower(x).compile().as_text()

    assert order_dependent_reductions(hlo(jax.lax.psum, jnp.ones(4, jnp.float32)))
    assert not order_dependent_reductions(hlo(jax.lax.pmax, jnp.ones(4, jnp.float32)))
    assert not order_dependent_reductions(hlo(jax.lax.psum, jnp.ones(4, jnp.int32)))


@needs_8
def test_batch_invariant_under_tensor_parallel_2_compiles_no_float_all_reduce(invariant_tp2):
    """On a CPU XLA's collectives add in one fixed order, so only the HLO shows what a GPU would run:
    the forward, samplers and logprobs hold no order-dependent cross-device sum, and the row-parallel
    Linears' sums (o_proj, down_proj) and the embedding lookup's are all-gathers."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=2, logprobs=2, prompt_logprobs=1)
    invariant_tp2.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)
    runner = invariant_tp2.llm_engine.engine_core.core.executor.runner
    kinds = {key.kind for key in runner.executables.compiled}
    assert {"forward", "sampler", "logprobs", "prompt logprobs"} <= kinds
    for key, compiled in runner.executables.compiled.items():
        hlo = compiled.as_text()
        assert order_dependent_reductions(hlo) == [], key
        if key.kind == "forward":
            partials = re.findall(rf"= f32\[2,\d+,{runner.arch.hidden_size}\]\S* all-gather\(", hlo)
            assert len(partials) == 2 * runner.arch.num_layers + 1, key


@needs_8
def test_batch_invariant_on_a_2x2_mesh_is_bitwise_among_others_and_the_plain_forwards(tmp_path):
    """A mesh= of four devices: each row-parallel sum adds four partials, in device order."""
    model = write_model(tmp_path)
    with LLM(model, mesh=mesh_of_four(), batch_invariant=True, **MESH_ENGINE) as llm:
        assert_bitwise_alone_and_among_others(llm, {7: (0, 7)}, max_tokens=4)
        assert_plain_logprobs_are_the_engines_bitwise(llm, max_tokens=4)


# -- the 8-device tests, in a child ---------------------------------------------------

@pytest.mark.skipif(jax.device_count() >= 8, reason="runs the mesh tests in this process")
def test_the_8_device_tests_in_a_child():
    run_with_host_devices(__file__, "2x2 or outside or tensor_parallel or reduction_finder", 8, "8 passed",
                          timeout_s=500)
