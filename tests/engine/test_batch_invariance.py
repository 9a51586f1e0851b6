"""batch_invariant=True: a request's tokens and logprobs the same bits alone and among others, at any
place of the batch, on one device and under tensor parallelism, and equal to the plain forward's
(get_logprobs_fn), which differentiates. The tensor-parallel tests need 8 devices; in a process with
fewer, the last test runs them in a child."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from tests.conftest import run_with_host_devices, tiny_model
from tests.engine.test_jax_program import ENGINE, MESH_ENGINE, mesh_of_four
from tests.engine.test_tensor_parallel import write_model

pytestmark = pytest.mark.timeout(600)
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")


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

@pytest.mark.skipif(jax.device_count() >= 8, reason="runs the tensor-parallel tests in this process")
def test_the_8_device_tests_in_a_child():
    run_with_host_devices(__file__, "tensor_parallel or reduction_finder or 2x2", 8, "5 passed", timeout_s=500)
