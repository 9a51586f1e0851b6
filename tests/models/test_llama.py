"""The decoder, its config and its loader, on CPU.

Logit parity is against HF transformers' fp32 logits stored as golden fixtures in
tests/fixtures/tiny/<name>/ (config.json, model.safetensors, golden.npz).
"""
import dataclasses
import functools
import importlib.resources
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.kernels import reference
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.kv_layout import model_kv_layout, model_kv_spec
from jaxllm.models.llama import LlamaForCausalLM, rope_inv_freq
from jaxllm.models.loader import create_model, hf_tensors, iter_hf_weights, path_to_hf_names
from jaxllm.sharding import make_mesh, named_sharding

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny")
GOLDEN_MODELS = ("llama", "llama_tied", "mistral", "qwen2", "qwen3")
BLOCK_SIZE = 16
NUM_BLOCKS = 16          # room for 256 tokens
TOKEN_BUCKET = 128       # every chunk is padded to this, so each model compiles once
MAX_NUM_REQS = 2         # one real request, one padding request


def make_step(model, attn_fn=reference.ragged_paged_attention):
    """The jitted step, in the split/merge form the runner uses: params as an
    argument, the graph static, kv caches donated."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, kv_caches, input_ids, positions, md):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(input_ids, positions, kv_caches, md, attn_fn)
        return m.compute_logits(hidden), kv_caches

    return functools.partial(step, state)


def run_prompt(step, config: ModelArchConfig, token_ids, chunks, cache_sharding=None):
    """Prefill one request in chunks (sizes summing to len(token_ids)) through a paged
    cache whose block tables are out of order (each KV cache group its own blocks);
    returns logits [len, vocab]."""
    layout, spec = model_kv_layout(config), model_kv_spec(config, BLOCK_SIZE)
    num_groups = len(layout.groups)
    arrays = spec.arrays(NUM_BLOCKS * num_groups, jnp.float32, jnp.float32)
    zeros = [jax.jit(lambda a=a: jnp.zeros(a.shape, a.dtype), out_shardings=cache_sharding) for a in arrays]
    kv_caches = [tuple(z() for z in zeros) for _ in range(layout.num_tensors)]
    tables = np.stack([g * NUM_BLOCKS + np.arange(NUM_BLOCKS, dtype=np.int32)[::-1] for g in range(num_groups)])
    block_tables = np.zeros((num_groups, MAX_NUM_REQS, NUM_BLOCKS), np.int32)
    block_tables[:, 0] = tables
    logits, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.int32)
        ids, positions = np.zeros(TOKEN_BUCKET, np.int32), np.zeros(TOKEN_BUCKET, np.int32)
        slots = np.full((num_groups, TOKEN_BUCKET), -1, np.int32)
        ids[:n], positions[:n] = token_ids[start:start + n], pos
        slots[:, :n] = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            query_start_loc=jnp.array([0, n, n], jnp.int32),
            seq_lens=jnp.array([start + n, 0], jnp.int32),
            block_tables=jnp.asarray(block_tables),
            num_seqs=jnp.array([1], jnp.int32))
        out, kv_caches = step(kv_caches, jnp.asarray(ids), jnp.asarray(positions), md)
        logits.append(np.asarray(out[:n]))
        start += n
    return np.concatenate(logits)


def fixture_config(name) -> ModelArchConfig:
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        return ModelArchConfig.from_hf_config(json.load(f))


def load_fixture(name):
    folder = os.path.join(FIXTURES, name)
    config = fixture_config(name)
    model = create_model(config, dtype=jnp.float32, mesh=make_mesh(), weights=iter_hf_weights(folder))
    return config, model, np.load(os.path.join(folder, "golden.npz"))


def golden_prompts(golden):
    """[(token ids, HF logits [len, vocab])] from golden.npz."""
    lengths = sorted(int(k.removeprefix("prompt_")) for k in golden.files if k.startswith("prompt_"))
    assert lengths, "golden.npz holds no prompt_<len> arrays"
    return [(golden[f"prompt_{n}"], golden[f"logits_{n}"]) for n in lengths]


def assert_logits_match_hf(name, config, model, golden, attn_fn=reference.ragged_paged_attention):
    """Each golden prompt's logits, prefilled whole and (past 32 tokens) in three chunks, within
    1e-4 of the largest HF logit."""
    step = make_step(model, attn_fn)
    for token_ids, hf_logits in golden_prompts(golden):
        n = len(token_ids)
        for chunks in [[n]] + ([[16, 16, n - 32]] if n > 32 else []):
            logits = run_prompt(step, config, token_ids, chunks)
            err = np.abs(logits - hf_logits).max()
            tol = 1e-4 * max(1.0, np.abs(hf_logits).max())
            assert err < tol, f"{name}: prompt of {n} tokens in chunks {chunks}: max error {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_logits_match_hf_transformers(name):
    assert_logits_match_hf(name, *load_fixture(name))


def test_unsupported_architecture_raises():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelArchConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_unknown_rope_type_raises():
    d = json.loads(importlib.resources.files("jaxllm.models.configs").joinpath("llama-3.1-8b.json").read_text())
    d["rope_scaling"]["rope_type"] = "longrope"
    with pytest.raises(ValueError, match="longrope"):
        ModelArchConfig.from_hf_config(d)


def test_linear_rope_scaling_divides_frequencies():
    base = ModelArchConfig(architecture="llama", vocab_size=8, hidden_size=32, intermediate_size=8,
                           num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
    scaled = dataclasses.replace(base, rope_scaling={"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(rope_inv_freq(scaled), rope_inv_freq(base) / 4, rtol=1e-6)
    with pytest.raises(ValueError, match="lacks"):
        dataclasses.replace(base, rope_scaling={"rope_type": "llama3", "factor": 8.0})


def test_sliding_window_reaches_attention_of_the_sliding_layers():
    with open(os.path.join(FIXTURES, "qwen2", "config.json")) as f:
        d = json.load(f)
    d.pop("layer_types")
    d.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)  # Qwen: layers >= 1 slide
    config = ModelArchConfig.from_hf_config(d)
    weights = iter_hf_weights(os.path.join(FIXTURES, "qwen2"))
    model = create_model(config, dtype=jnp.float32, mesh=make_mesh(), weights=weights)
    windows = []

    def recording_attn(q, k_cache, v_cache, *args, scale, sliding_window=None):
        windows.append(sliding_window)
        return q

    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    kv = [(jnp.zeros(shape), jnp.zeros(shape))] * config.num_layers
    md = AttentionMetadata(jnp.zeros((2, 4), jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32),
                           jnp.zeros((2, 2, NUM_BLOCKS), jnp.int32), jnp.ones(1, jnp.int32))  # 2 KV cache groups
    ids = jnp.zeros(4, jnp.int32)
    jax.eval_shape(lambda: model(ids, ids, kv, md, recording_attn))
    assert windows == [None, 8]
    mistral = ModelArchConfig.from_hf_config({**d, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [4096, 4096]


TINY = ModelArchConfig(architecture="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)


def random_hf_tensors(config: ModelArchConfig, seed=0):
    """Random tensors named and laid out as a HF checkpoint of `config` ([out, in]
    Linear weights), made on the host from the abstract model's shapes."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    return [(name, rng.normal(0, 0.02, shape).astype(np.float32))
            for name, [(_, shape), *_] in hf_tensors(config, dict(nnx.to_flat_state(nnx.state(abstract)))).items()]


def unpacked_hf_tensors(config: ModelArchConfig, model) -> dict[str, np.ndarray]:
    """The model's params as the HF tensors they were loaded from (HF names and layout):
    qkv_proj and gate_up_proj unpacked, by their layout written out here, into their parts."""
    g, head_dim = config.num_heads // config.num_kv_heads, config.head_dim
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = np.asarray(var.get_value())
        if path[-2] == "qkv_proj":  # [..., num_kv_heads * (g + 2) * head_dim]: per KV head, g q heads, k, v
            rest = value.shape[:-1]  # (hidden,) for the kernel, () for the bias
            groups = value.T.reshape(config.num_kv_heads, g + 2, head_dim, *rest)
            parts = [groups[:, :g].reshape(-1, *rest), groups[:, g].reshape(-1, *rest),
                     groups[:, g + 1].reshape(-1, *rest)]
        elif path[-2] == "gate_up_proj":  # [hidden, 2, intermediate]
            parts = [value[:, 0].T, value[:, 1].T]
        else:
            parts = [value.T if path[-1] == "kernel" else value]
        tensors.update(zip(path_to_hf_names(path, config), parts))
    return tensors


def create(weights, dtype=jnp.float32):
    return create_model(TINY, dtype=dtype, mesh=make_mesh(), weights=weights)


def test_loader_names_a_missing_tensor():
    weights = [(n, a) for n, a in random_hf_tensors(TINY) if n != "model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.self_attn\.k_proj\.bias"):
        create(weights)


def test_loader_names_an_unexpected_tensor():
    extra = ("model.layers.0.mlp.fc1.weight", np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.fc1\.weight'"):
        create(random_hf_tensors(TINY) + [extra])


def test_loader_skips_calibrated_kv_cache_scales_with_a_warning(caplog):
    scales = [(f"model.layers.{i}.self_attn.{kind}", np.float32(0.5)) for i in range(2) for kind in ("k_scale", "v_scale")]
    want = create(random_hf_tensors(TINY))
    with caplog.at_level("WARNING", logger="jaxllm.models.loader"):
        got = create(random_hf_tensors(TINY) + scales)
    assert "the checkpoint's 4 calibrated attention scales (k_scale, v_scale, ...) are not read" in caplog.text
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(got), nnx.state(want)))


def test_loader_names_a_misshaped_tensor():
    bad = [(n, a[:-1] if n == "model.norm.weight" else a) for n, a in random_hf_tensors(TINY)]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(31,\), expected \(32,\)"):
        create(bad)


def test_loader_transposes_casts_and_places_each_tensor():
    weights = random_hf_tensors(TINY)
    model = create(iter(weights), dtype=jnp.bfloat16)
    by_name = unpacked_hf_tensors(TINY, model)
    assert set(by_name) == {n for n, _ in weights}
    for name, array in weights:
        value = by_name[name]
        assert value.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(value, np.float32), array, rtol=1e-2, atol=1e-6, err_msg=name)


def test_loader_packs_q_k_v_by_kv_head_and_gate_up_side_by_side():
    """qkv_proj's columns, per KV head j: q heads 2j, 2j + 1 (TINY: 4 q heads over 2 KV heads), k head j, v head j."""
    weights = dict(random_hf_tensors(TINY))
    layer = create(weights.items()).layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    p, d = "model.layers.1.", TINY.head_dim
    q, k, v = (weights[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    want = np.concatenate([q[:, :2 * d], k[:, :d], v[:, :d], q[:, 2 * d:], k[:, d:], v[:, d:]], axis=1)
    np.testing.assert_array_equal(np.asarray(attn.qkv_proj.kernel[...]), want)
    q_bias, k_bias, v_bias = (weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
    want_bias = np.concatenate([q_bias[:2 * d], k_bias[:d], v_bias[:d], q_bias[2 * d:], k_bias[d:], v_bias[d:]])
    np.testing.assert_array_equal(np.asarray(attn.qkv_proj.bias[...]), want_bias)
    gate_up = np.asarray(mlp.gate_up_proj.kernel[...])  # [hidden, 2, intermediate]
    np.testing.assert_array_equal(gate_up[:, 0], weights[p + "mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(gate_up[:, 1], weights[p + "mlp.up_proj.weight"].T)


def test_dummy_weights_have_shapes_dtypes_shardings():
    mesh = make_mesh()
    # few distinct shapes: each costs a compile of the random generator on CPU
    config = ModelArchConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    model = create_model(config, dtype=jnp.bfloat16, mesh=mesh, weights=None)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert params[("embed_tokens", "embedding")].shape == (128, 64)
    assert params[("layers", 1, "self_attn", "qkv_proj", "kernel")].shape == (64, 2 * (2 + 2) * 16)
    assert params[("layers", 1, "mlp", "gate_up_proj", "kernel")].shape == (64, 2, 64)
    assert params[("layers", 0, "self_attn", "o_proj", "kernel")].shape == (64, 64)
    assert params[("lm_head", "kernel")].shape == (64, 128)
    for path, var in params.items():
        value = var[...]
        assert isinstance(value, jax.Array) and value.dtype == jnp.bfloat16, path
        assert value.sharding == named_sharding(mesh, var.get_metadata()["out_sharding"]), path
        assert bool(jnp.any(value != 0)), path
    assert float(jnp.std(params[("lm_head", "kernel")][...].astype(jnp.float32))) < 0.1
    assert bool(jnp.all(params[("norm", "weight")][...] == 1))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "qwen3-0.6b", "qwen3-8b"])
def test_bundled_configs_parse(name):
    d = json.loads(importlib.resources.files("jaxllm.models.configs").joinpath(f"{name}.json").read_text())
    config = ModelArchConfig.from_hf_config(d)
    assert config.head_dim == (64 if name == "llama-3.2-1b" else 128) and config.num_kv_heads == 8
    if name.startswith("llama"):
        assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 500000.0
        assert config.tie_word_embeddings == (name == "llama-3.2-1b")
    else:
        assert config.qk_norm and config.tie_word_embeddings == (name == "qwen3-0.6b")
        assert config.sliding_window is None


_TP_CHECK = """
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import test_llama as T
from jaxllm.models.loader import create_model, iter_hf_weights
from jaxllm.kernels import attention
from jaxllm.kernels.attention import get_attention_fn
from jaxllm.sharding import kv_cache_sharding, make_mesh

mesh = make_mesh(tensor_parallel_size=2)
assert get_attention_fn("reference", mesh) is not get_attention_fn("reference")
config = T.fixture_config("llama")
weights = iter_hf_weights(T.os.path.join(T.FIXTURES, "llama"))
model = create_model(config, dtype=jnp.float32, mesh=mesh, weights=weights)
layer = model.layers[0]
assert model.embed_tokens.embedding[...].sharding.spec == P("model", None)
assert layer.self_attn.qkv_proj.kernel[...].sharding.spec == P(None, "model")
assert layer.mlp.gate_up_proj.kernel[...].sharding.spec == P(None, None, "model")
assert layer.self_attn.o_proj.kernel[...].sharding.spec == P("model", None)
assert layer.mlp.down_proj.kernel[...].sharding.spec == P("model", None)
assert model.lm_head.kernel[...].sharding.spec == P(None, "model")
assert model.norm.weight[...].sharding.spec == P(None)
golden = np.load(T.os.path.join(T.FIXTURES, "llama", "golden.npz"))
want, bound = golden["logits_33"], 1e-4 * np.abs(golden["logits_33"]).max()
logits = T.run_prompt(T.make_step(model), config, golden["prompt_33"], [16, 16, 1], kv_cache_sharding(mesh))
assert np.abs(logits - want).max() < bound
# A kernel backend runs per device on its own heads (shard_map): the Pallas kernel, interpreted.
seen = []
def pallas_spy(q, *args, **kwargs):
    seen.append(q.shape)
    return get_attention_fn("pallas")(q, *args, **kwargs)
step = T.make_step(model, attention.per_device_heads(pallas_spy, mesh))
logits = T.run_prompt(step, config, golden["prompt_33"], [16, 16, 1], kv_cache_sharding(mesh))
assert np.abs(logits - want).max() < bound
assert seen and all(shape[1] == config.num_heads // 2 for shape in seen), seen
"""


def test_tensor_parallel_over_two_devices_matches_hf():
    """The same model on a 2-device mesh: only the mesh changes, and the logits don't."""
    from tests.conftest import host_devices_flags  # not at the top: the child imports this module alone
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(2), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _TP_CHECK], check=True, env=env, cwd=os.path.dirname(__file__))
