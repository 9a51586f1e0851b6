"""Quantized checkpoints (models/quant_checkpoint.py, models/int4.py, models/fp8.py) against their
dequantized twins (tests/models/quant_fixtures.py): the same tiny Llama with every quantized
weight replaced by its float64 dequantization by the format's definition.

HF transformers runs compressed-tensors' FP8 on a CPU as the format defines it (activations
fake-quantized to e4m3), so those checkpoints are committed with its logits
(scripts/make_quant_fixtures.py). It runs none of the others as they are on a CPU (AWQ and GPTQ
need CUDA packages; FineGrainedFP8 dequantizes the whole model there), so for them the reference
is the twin, run by the engine's own float32 path, itself tested against transformers
(tests/models/test_llama.py).

Tolerances. AWQ and GPTQ keep activations in float32 on a CPU and the weights dequantize exactly,
so only the order of float32 sums differs: logprobs within 1e-4, the same greedy tokens. The FP8
formats also round every activation to e4m3 (3 mantissa bits: up to 2^-4 of a value, per token,
per Linear): on this random model, whose logits are flat (std 1.2), that moves the logprobs by
0.07-0.09 nats on average (0.5-0.7 at most) and the top token at 7.5% of the positions, as the
twin with activations left alone measures; the tests allow 0.15 on average and 85% agreement.
A misplaced weight moves them by more than 1 nat (a transposed one: 1.3 on average, measured).
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.device_facts import DeviceFacts
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fp8 import E4M3_MAX, BlockFp8Linear, Fp8Linear
from jaxllm.models.hf_checkpoint import iter_hf_weights
from jaxllm.models.int4 import Int4Linear
from jaxllm.models.llama import Linear
from jaxllm.models.quant_checkpoint import quantized_weights
from jaxllm.models.quant_config import resolve_quantization
from tests.conftest import run_with_host_devices, tiny_model
from tests.engine.test_prefix_caching import plain_forward_logits
from tests.models import quant_fixtures as qf

pytestmark = pytest.mark.timeout(600)

ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, skip_tokenizer_init=True,
              show_progress=False, enable_multiprocessing=False)
PROMPT = qf.PROMPT
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
# name -> (quantization_config, the fixture's quantizer, Linears left unquantized, exact)
VARIANTS = {
    "awq": (AWQ, qf.awq(32), (), True),
    "gptq_act_order": ({**GPTQ, "desc_act": True, "sym": False}, qf.gptq(32, act_order=True, sym=False), (), True),
    "gptq_symmetric": (GPTQ, qf.gptq(32, act_order=False, sym=True), (), True),
    **{name: (*fixture, False) for name, fixture in qf.CT_FIXTURES.items()},
    "fp8_block": (FP8_BLOCK, qf.fp8_block((16, 16), "weight_scale_inv"), (), False),
    "fp8_tensor_static": ({"quant_method": "fp8", "activation_scheme": "static"},
                          qf.fp8_channel(per_tensor=True, static_input_scale=8 / E4M3_MAX, scalar=True), (), False),
}
ARCH = ModelArchConfig.from_hf_config(qf.config())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(variant) -> (its folder, its dequantized twin's), written once."""
    root = tmp_path_factory.mktemp("quantized")

    @functools.cache
    def write(name):
        quantization_config, quantize, dense, _ = VARIANTS[name]
        return qf.write_pair(root, name, quantization_config, quantize, dense=set(dense))
    return write


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def assert_close_to_twin(got: np.ndarray, want: np.ndarray, exact: bool) -> None:
    """Logprobs within the module docstring's tolerances."""
    if exact:
        np.testing.assert_allclose(got, want, atol=1e-4)
    else:
        assert np.abs(got - want).mean() < 0.15


@pytest.mark.parametrize("name", ["gptq_symmetric", "ct_fp8_channel", "ct_fp8_block", "fp8_tensor_static"])
def test_a_loaded_checkpoint_computes_its_dequantized_twins_logprobs(checkpoint, name):
    path, twin = checkpoint(name)
    got, want = log_softmax(plain_forward_logits(path, ARCH, PROMPT)), log_softmax(plain_forward_logits(twin, ARCH, PROMPT))
    exact = VARIANTS[name][3]
    assert_close_to_twin(got, want, exact)
    agreement = (got.argmax(-1) == want.argmax(-1)).mean()
    assert agreement == 1.0 if exact else agreement >= 0.85


@pytest.mark.parametrize("name", sorted(qf.CT_FIXTURES))
def test_compressed_tensors_checkpoints_compute_transformers_logprobs(name):
    """The committed checkpoints against transformers' logits (scripts/make_quant_fixtures.py), which
    quantize the activations as the format says. Static and per-token scales: the same numbers to
    float32 rounding (3e-6 nats at most, measured). Per token and block (ct_fp8_block): transformers'
    scales differ from ours by a float32 ulp or two, so the rare value at an e4m3 rounding midpoint
    (an e4m3 step is 1/16 of a value) rounds the other way: 7e-4 nats on average, 0.1 at most
    (measured), the same top token everywhere."""
    golden = np.load(os.path.join(tiny_model(name), "golden.npz"))
    got = log_softmax(plain_forward_logits(tiny_model(name), ARCH, list(golden["prompt"])))
    want = log_softmax(golden["logits"])
    if name == "ct_fp8_block":
        assert np.abs(got - want).mean() < 2e-3 and np.abs(got - want).max() < 0.2
    else:
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", ["awq", "gptq_act_order", "ct_fp8_tensor_static", "fp8_block"])
def test_the_engine_runs_a_checkpoint_as_its_dequantized_twin(checkpoint, name):
    """LLM(model=folder) reads the format from config.json: its prompt logprobs and greedy tokens
    against the twin's logprobs over the same text (AWQ and GPTQ: the twin's greedy tokens)."""
    path, twin = checkpoint(name)
    exact = VARIANTS[name][3]
    with LLM(path, **ENGINE) as llm:
        assert llm.llm_engine.config.model.quantization.method == VARIANTS[name][0]["quant_method"]
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    generated = list(out.outputs[0].token_ids)
    text = PROMPT + generated
    want = log_softmax(plain_forward_logits(twin, ARCH, text))[:-1]  # [position, the next token's logprobs]
    got = [d[t].logprob for t, d in zip(PROMPT[1:], out.prompt_logprobs[1:])]
    got += [d[t].logprob for t, d in zip(generated, out.outputs[0].logprobs)]
    assert_close_to_twin(np.array(got), want[np.arange(len(text) - 1), text[1:]], exact)
    best = want[len(PROMPT) - 1:].argmax(-1)
    if exact:
        assert generated == list(best)
    else:  # each greedy token is the twin's best or within the FP8 tolerance of it
        chosen = want[np.arange(len(PROMPT) - 1, len(text) - 1), generated]
        assert np.all(chosen >= want[len(PROMPT) - 1:].max(-1) - 0.5)


def _convert(tensors: dict, quantization_config: dict) -> dict:
    quant = resolve_quantization(None, {"quantization_config": quantization_config}, "hf")
    return {name: np.asarray(s[tuple(slice(None) for _ in s.shape)]) for name, s in quantized_weights(tensors.items(), quant)}


def _int4_linear(converted: dict, module: str, act_order: bool) -> Int4Linear:
    packed = converted[f"{module}.weight_packed"].T
    linear = Int4Linear(packed.shape[0] * 2, packed.shape[1:], ("embed", "mlp"), group_size=32, act_order=act_order,
                        bias=None, dtype=jnp.float32, mesh=None)
    for leaf in ("weight_packed", "weight_scale", "weight_zero"):
        getattr(linear, leaf).set_value(jnp.asarray(converted[f"{module}.{leaf}"].T))
    if act_order:
        linear.input_perm.set_value(jnp.asarray(converted[f"{module}.input_perm"]))
    return linear


def text_logprobs(llm, text: list[int]) -> np.ndarray:
    """log p(text[i + 1] | text[:i + 1]) over the text, from the engine's prompt logprobs."""
    out = llm.generate([{"prompt_token_ids": text}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    return np.array([d[t].logprob for t, d in zip(text[1:], out.prompt_logprobs[1:])])


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_an_fp8_moe_checkpoint_runs_as_its_dequantized_twin(tmp_path, model):
    """Qwen3-MoE and DeepSeek-V3 with every Linear and expert in FP8 blocks (the layout Qwen and DeepSeek
    publish their FP8 MoE models in): the Linears of whole blocks load as they are, the experts
    dequantized, then held in e4m3 with a scale per expert and output channel. DeepSeek's kv_b_proj (held
    in the model's dtype) and its Linears of partial blocks (q_a_proj's 24 rows, q_b_proj's 24 columns,
    kv_a_proj_with_mqa's 24 rows in blocks of 16) load dequantized. Its logprobs over a prompt and its
    greedy continuation are within the FP8 tolerance of the twin's (the same model dequantized, in float32)."""
    quantization_config, quantize, _, _ = VARIANTS["fp8_block"]
    rng, quantized, twin = np.random.default_rng(1), {}, {}
    for name, w in load_file(os.path.join(tiny_model(model), "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not module.endswith(("_proj", "_proj_with_mqa")):  # the embedding, norms, routers and the LM head
            quantized[name] = twin[name] = w
            continue
        parts, dequantized = quantize(w, module, rng)
        quantized.update({f"{module}.{leaf}": array for leaf, array in parts.items()})
        twin[name] = dequantized.astype(np.float32)
    with open(os.path.join(tiny_model(model), "config.json")) as f:
        cfg = json.load(f)
    path = qf.write(tmp_path / "fp8", {**cfg, "quantization_config": quantization_config}, quantized)
    with LLM(path, **ENGINE) as llm:
        layers = llm.llm_engine.engine_core.core.executor.runner.weights.model().layers
        assert layers[-1].mlp.experts.down_proj[...].dtype == jnp.float8_e4m3fn
        if model == "deepseek_v3":
            attention = layers[0].self_attn
            assert isinstance(attention.o_proj, BlockFp8Linear)  # 32 x 64: whole blocks
            assert all(isinstance(getattr(attention, name), Linear)
                       for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"))
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
        text = PROMPT + list(out.outputs[0].token_ids)
        got = text_logprobs(llm, text)
    with LLM(qf.write(tmp_path / "twin", cfg, twin), **ENGINE) as llm:
        want = text_logprobs(llm, text)
    assert_close_to_twin(got, want, exact=False)


def test_act_order_gptq_equals_the_same_weights_without_act_order_after_permutation():
    """GPTQ act-order: rows in any order with g_idx naming their groups. Sorting the rows by group
    (the checkpoint without act-order) and permuting the input the same way gives the same layer."""
    rng = np.random.default_rng(5)
    w, group, module = rng.standard_normal((48, 128)).astype(np.float32), 32, "model.layers.0.mlp.up_proj"
    g_idx = qf.gptq_g_idx(128, group, act_order=True, rng=rng)
    q, zeros, scales, _ = qf.int4_groups(w, g_idx, group, sym=False)
    perm = np.argsort(g_idx, kind="stable")
    act_order = {"qweight": qf.pack_gptq_rows(q), "g_idx": g_idx}
    in_order = {"qweight": qf.pack_gptq_rows(q[perm]), "g_idx": np.arange(128, dtype=np.int32) // group}
    shared = {"qzeros": qf.pack_gptq_columns((zeros - 1) & 0xF), "scales": scales}
    a = _convert({f"{module}.{k}": v for k, v in {**act_order, **shared}.items()}, {**GPTQ, "desc_act": True})
    b = _convert({f"{module}.{k}": v for k, v in {**in_order, **shared}.items()}, GPTQ)
    np.testing.assert_array_equal(a[f"{module}.input_perm"], perm)
    for leaf in ("weight_packed", "weight_scale", "weight_zero"):
        np.testing.assert_array_equal(a[f"{module}.{leaf}"], b[f"{module}.{leaf}"])
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.float32)
    np.testing.assert_array_equal(_int4_linear(a, module, True)(x), _int4_linear(b, module, False)(x[:, perm]))


def test_a_static_input_scale_saturates_and_scales_as_float64_says():
    rng = np.random.default_rng(6)
    w8 = jnp.asarray(rng.standard_normal((24, 32)) * 50, jnp.float8_e4m3fn)
    w_scale, input_scale = jnp.asarray(rng.uniform(1e-3, 2e-3, 24), jnp.float32), 2.0 / E4M3_MAX
    x = rng.standard_normal((6, 32)).astype(np.float32) * 2
    x[0, 0] = 10.0  # past the calibrated range (|x| <= 2): saturates at 448 * input_scale
    linear = Fp8Linear(w8, w_scale, ("mlp", "embed"), None, jnp.asarray(input_scale, jnp.float32))
    x8 = np.asarray(jnp.asarray(np.clip(x / input_scale, -E4M3_MAX, E4M3_MAX), jnp.float8_e4m3fn), np.float64)
    want = (x8 * input_scale) @ (np.asarray(w8, np.float64) * np.asarray(w_scale, np.float64)[:, None]).T
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


# ---- bad checkpoints: each error names the tensor or the config field ----

def create_config(path, **kwargs):
    return EngineArgs(model=str(path), skip_tokenizer_init=True, **kwargs).create_config(
        DeviceFacts("cpu", 8, "reference"))


def with_config(folder, **changes) -> str:
    """The checkpoint at `folder` with its quantization_config's keys changed."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {**cfg["quantization_config"], **changes}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def load(path):
    return plain_forward_logits(path, ARCH, PROMPT[:4])


@pytest.mark.parametrize("changes, message", [
    ({"bits": 8}, "quantization_config.bits must be 4"),
    ({"group_size": 48}, r"quantization_config.group_size must be one of \(32, 64, 128\)"),
    ({"zero_point": False}, "quantization_config.zero_point must be true"),
    ({"version": "gemv"}, "quantization_config.version must be 'gemm'"),
])
def test_unsupported_awq_configs_name_their_field(checkpoint, tmp_path, changes, message):
    import shutil
    folder = shutil.copytree(checkpoint("awq")[0], tmp_path / "awq")
    with pytest.raises(ValueError, match=message):
        create_config(with_config(folder, **changes))


@pytest.mark.parametrize("config, message", [
    ({**GPTQ, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2'"),
    ({**GPTQ, "lm_head": True}, "quantization_config.lm_head must be false"),
    ({**qf.CT_FIXTURES["ct_fp8_channel"][0], "format": "pack-quantized"},
     "quantization_config.format 'pack-quantized' is not supported"),
    ({**qf.CT_FIXTURES["ct_fp8_channel"][0], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "dynamic": False, "strategy": "group"}}}},
     "quantization_config.config_groups.group_0.weights.num_bits must be 8"),
    ({**FP8_BLOCK, "activation_scheme": "static"}, "activation_scheme must be 'dynamic' with weight_block_size"),
    ({**FP8_BLOCK, "weight_block_size": [128]}, "quantization_config.weight_block_size must be two powers of two"),
])
def test_unsupported_configs_name_their_field(tmp_path, config, message):
    folder = qf.write(tmp_path, {**qf.config(), "quantization_config": config}, {})
    with pytest.raises(ValueError, match=message):
        create_config(folder)


def test_a_quantization_that_is_not_the_checkpoints_names_both(checkpoint):
    with pytest.raises(ValueError, match="quantization='awq' does not match the checkpoint's "
                                         "quantization_config.quant_method 'gptq'"):
        create_config(checkpoint("gptq_symmetric")[0], quantization="awq")
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint with a quantization_config"):
        create_config(checkpoint("awq")[1], quantization="gptq")


def test_groups_that_would_straddle_two_devices_are_refused(checkpoint):
    """intermediate_size 128 over 8 devices: 16 rows of down_proj's input each, half a group of 32."""
    with pytest.raises(ValueError, match=r"group_size 32 must divide intermediate_size / tensor_parallel_size \(16\)"):
        create_config(checkpoint("awq")[0], tensor_parallel_size=8)
    with pytest.raises(ValueError, match=r"the weight block's columns \(16\) must divide .*\(8\)"):
        create_config(checkpoint("fp8_block")[0], tensor_parallel_size=8)


def test_a_latent_models_blocks_that_would_straddle_two_devices_are_refused(tmp_path):
    """DeepSeek-V3's shared experts' 16 intermediate rows are one block of 16, 8 a device over 2; its
    o_proj reads 8 heads x 8 values: 64 columns, 8 a device over 8."""
    import shutil
    folder = shutil.copytree(tiny_model("deepseek_v3"), tmp_path / "fp8")
    with open(folder / "config.json") as f:
        cfg = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({**cfg, "quantization_config": VARIANTS["fp8_block"][0]}, f)
    create_config(str(folder))  # on one device every block is whole
    with pytest.raises(ValueError, match=r"the shared experts' intermediate rows \(16\) split over "
                                         r"tensor_parallel_size=2 must be whole blocks of 16"):
        create_config(str(folder), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"o_proj's columns \(64\) split over tensor_parallel_size=8 must be whole "
                                         r"blocks of 16"):
        create_config(str(folder), tensor_parallel_size=8)


def rewrite(folder, target, drop=(), replace=None) -> str:
    """A copy of the checkpoint at `folder` in `target`, without the tensors `drop`, with `replace`'s."""
    import shutil
    from safetensors.numpy import save_file
    shutil.copytree(folder, target)
    tensors = {}
    for name, source in iter_hf_weights(str(folder)):
        if name not in drop:
            tensors[name] = np.asarray(source[tuple(slice(None) for _ in source.shape)])
    save_file({**tensors, **(replace or {})}, os.path.join(target, "model.safetensors"))
    return str(target)


def test_a_missing_scale_is_named(checkpoint, tmp_path):
    path = rewrite(checkpoint("awq")[0], tmp_path / "c", drop={"model.layers.1.mlp.down_proj.scales"})
    with pytest.raises(ValueError, match="missing 1 tensor.* model.layers.1.mlp.down_proj.scales"):
        load(path)


def test_scales_of_another_group_size_are_named(checkpoint, tmp_path):
    path = with_config(rewrite(checkpoint("gptq_symmetric")[0], tmp_path / "c"), group_size=64)
    with pytest.raises(ValueError, match=r"tensor model.layers.0.\w+.\w+_proj.scales has shape \((\d+), \d+\), "
                                         r"expected .* quantization_config.group_size \(64\)"):
        load(path)


def test_act_order_rows_without_desc_act_are_named(checkpoint, tmp_path):
    path = with_config(rewrite(checkpoint("gptq_act_order")[0], tmp_path / "c"), desc_act=False)
    with pytest.raises(ValueError, match=r"tensor model.layers.0.\w+.\w+_proj.g_idx orders the rows by activation"):
        load(path)


def test_fused_parts_with_different_g_idx_are_named(checkpoint, tmp_path):
    name = "model.layers.0.self_attn.k_proj.g_idx"
    path = rewrite(checkpoint("gptq_act_order")[0], tmp_path / "c",
                   replace={name: qf.gptq_g_idx(64, 32, True, np.random.default_rng(9))})
    with pytest.raises(ValueError, match=r"tensors .*q_proj.input_perm', '.*k_proj.input_perm'.* differ.* share "
                                         r"their g_idx"):
        load(path)


def test_an_unquantized_weight_where_fp8_is_due_is_named(checkpoint, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    path = rewrite(checkpoint("fp8_block")[0], tmp_path / "c", replace={name: np.zeros((128, 64), np.float32)})
    with pytest.raises(ValueError, match=f"tensor {name} has dtype F32, expected F8_E4M3"):
        load(path)


def test_block_scales_of_the_wrong_shape_are_named(checkpoint, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    path = rewrite(checkpoint("fp8_block")[0], tmp_path / "c", replace={name: np.ones((4, 4), np.float32)})
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \(4, 4\), expected \(8, 4\)"):
        load(path)


# ---- tensor parallelism ----

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: the last test runs these with 8")
TP_CONFIG = qf.config(num_heads=8, num_kv_heads=2, intermediate=256)  # 4 devices: 32 rows of o and down a device


@needs_8
@pytest.mark.parametrize("name", ["gptq_act_order", "fp8_block"])
def test_quantized_weights_shard_over_devices_as_one_devices(tmp_path, name):
    """Over 4 devices (the 2 KV heads repeated), and in 2 pipeline stages of 2 (each layer's kernels on its
    stage's devices): groups and blocks whole on each device, the kernels per device, the row-parallel
    products summed: one device's tokens and logprobs."""
    quantization_config, quantize, _, exact = VARIANTS[name]
    path, _ = qf.write_pair(tmp_path, name, quantization_config, quantize, cfg=TP_CONFIG)
    runs = []
    for tp, pp in ((1, 1), (4, 1), (2, 2)):
        with LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE) as llm:
            out = llm.generate([{"prompt_token_ids": PROMPT[:20]}], SamplingParams(
                max_tokens=6, temperature=0, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
        runs.append((list(out.token_ids), [[d[t].logprob for t in sorted(d)] for d in out.logprobs]))
    for run in runs[1:]:
        assert run[0] == runs[0][0]
        np.testing.assert_allclose(np.array(run[1]), np.array(runs[0][1]), rtol=1e-4, atol=1e-4 if exact else 2e-3)


@pytest.mark.skipif(jax.device_count() >= 8, reason="runs the tests above itself")
def test_quantized_tensor_parallelism_with_8_host_devices():
    run_with_host_devices(__file__, "shard_over_devices", 8, "2 passed", timeout_s=500)
