"""The engine inside a JAX program: params and mesh handed over in memory (the engine's layout
and HF names), weights updated without a restart or a recompilation, generation paused and
resumed around an update, memory freed and regained between rollouts, and the plain forward a
trainer differentiates (with batch_invariant=True: tests/engine/test_batch_invariance.py).
The mesh tests need 8 devices; in a process with fewer, the last test runs them in a child."""
import asyncio
import os
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


# -- 5. the plain forward (batch invariance: tests/engine/test_batch_invariance.py) ---------------

def test_the_plain_forward_is_close_to_the_engine_without_batch_invariance(llm):
    prompt = list(range(40, 70))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    plain = np.asarray(llm.get_logprobs_fn()(llm.get_params(), jnp.array(prompt, jnp.int32)))
    np.testing.assert_allclose(plain, [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])],
                               rtol=0, atol=1e-4)


# -- the 8-device tests, in a child ---------------------------------------------------

@pytest.mark.skipif(jax.device_count() >= 8, reason="runs the mesh tests in this process")
def test_the_8_device_tests_in_a_child():
    run_with_host_devices(__file__, "2x2 or outside", 8, "3 passed",
                          timeout_s=500)
