"""DeepSeek-V2 and V3 (multi-head latent attention, DeepSeek's experts) on CPU.

Parity is against HF transformers' fp32 outputs in tests/fixtures/tiny/deepseek_v{2,3}/golden.npz
(scripts/make_fixtures.py). The latent attention layer is checked against a float64 reference that
expands every head's keys and values, as HF does, over ragged batches of prefill chunks and decode
tokens on shuffled block tables. The tests that hold for both prefill forms (JAXLLM_MLA_PREFILL:
absorbed, expanded) run over both. With fewer than 2 devices, the tensor-parallel test runs in a
child with 2 forced host devices.
"""
import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.device_facts import DeviceFacts
from jaxllm.kernels import reference
from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.deepseek import PREFILL_FORMS, prefill_form
from jaxllm.models.fp8 import Fp8Linear
from jaxllm.models.llama import Linear, rope_cos_sin, rope_inv_freq
from jaxllm.models.loader import abstract_params, checkpoint_params, iter_hf_weights
from jaxllm.models.yarn import yarn_attention_factor
from jaxllm.utils import cdiv
from tests.conftest import engines_warmed_up, run_with_host_devices, tiny_model
from tests.models.test_llama import assert_logits_match_hf, load_fixture
from tests.models.test_moe import (ENGINE, assert_greedy_is_hfs, assert_routed_experts_are_a_plain_forwards,
                                   fixture_hf_config)

MODELS = ("deepseek_v2", "deepseek_v3")
# A pool of 12 blocks of 16 tokens, where 4 requests of up to 80 tokens want 20: the run preempts.
TIGHT_ENGINE = dict(ENGINE, max_model_len=128, num_gpu_blocks_override=12)
needs_2 = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices: the last test runs it with 2")


def build_with(form: str, make):
    """make() with JAXLLM_MLA_PREFILL=form while the model is built (the layers read it then)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAXLLM_MLA_PREFILL", form)
        return make()


@pytest.fixture(scope="module", params=PREFILL_FORMS)
def v3_engine(request):
    with engines_warmed_up():  # nothing compiles after warm-up
        llm = build_with(request.param, lambda: LLM(tiny_model("deepseek_v3"), **TIGHT_ENGINE))
    with llm:
        assert runner(llm).weights.model().layers[0].self_attn.prefill == request.param
        yield llm


def runner(llm):
    return llm.llm_engine.engine_core.core.executor.runner


@pytest.mark.parametrize("form", PREFILL_FORMS)
@pytest.mark.parametrize("name", MODELS)
def test_logits_of_whole_and_chunked_prompts_match_hf_transformers(name, form):
    config, model, golden = build_with(form, lambda: load_fixture(name))
    assert model.layers[0].self_attn.prefill == form
    assert_logits_match_hf(name, config, model, golden)


@pytest.mark.parametrize("form", PREFILL_FORMS)
@pytest.mark.usefixtures("warm_up")
def test_v2_greedy_tokens_and_logprobs_match_hf_transformers_and_nothing_compiles_after_warm_up(form):
    with build_with(form, lambda: LLM(tiny_model("deepseek_v2"), **ENGINE)) as llm:
        assert runner(llm).weights.model().layers[0].self_attn.prefill == form
        before = llm.llm_engine.get_stats()["num_compilations"]
        assert_greedy_is_hfs(llm, "deepseek_v2")
        assert llm.llm_engine.get_stats()["num_compilations"] == before


def test_the_prefill_form_is_jaxllm_mla_prefill_expanded_unless_asked(monkeypatch):
    monkeypatch.delenv("JAXLLM_MLA_PREFILL", raising=False)
    assert prefill_form() == "expanded"
    monkeypatch.setenv("JAXLLM_MLA_PREFILL", "absorbed")
    assert prefill_form() == "absorbed"
    monkeypatch.setenv("JAXLLM_MLA_PREFILL", "naive")
    with pytest.raises(ValueError, match="JAXLLM_MLA_PREFILL must be one of \\('absorbed', 'expanded'\\), got 'naive'"):
        prefill_form()


def test_fp8_quantizes_all_but_the_routers_and_the_absorbed_kv_b_proj():
    """quantization="fp8": the projections, the dense MLP and the routed and shared experts in e4m3;
    the router and kv_b_proj (absorbed into the queries and outputs) as loaded."""
    with LLM(tiny_model("deepseek_v2"), quantization="fp8", **ENGINE) as llm:
        model = llm.llm_engine.engine_core.core.executor.runner.weights.model()
        attn, moe = model.layers[1].self_attn, model.layers[1].mlp
        assert isinstance(attn.kv_a_proj_with_mqa, Fp8Linear) and isinstance(moe.shared_experts.down_proj, Fp8Linear)
        assert type(attn.kv_b_proj) is Linear and type(moe.gate) is not Fp8Linear
        assert moe.experts.gate_up_proj[...].dtype == jnp.float8_e4m3fn
        assert_greedy_is_hfs(llm, "deepseek_v2", logprobs_too=False)


def test_v3_greedy_tokens_and_logprobs_match_hf_transformers_and_nothing_compiles_after_warm_up(v3_engine):
    before = v3_engine.llm_engine.get_stats()["num_compilations"]
    assert_greedy_is_hfs(v3_engine, "deepseek_v3")
    assert v3_engine.llm_engine.get_stats()["num_compilations"] == before


def test_routed_experts_are_the_grouped_routers_choices_in_a_plain_forward(v3_engine):
    """V3's sigmoid scores with their bias, in the 2 best of 4 groups: the 3 experts of each generated token
    at its 2 sparse layers (the first is dense), a 40-token prompt prefilled in two chunks."""
    prompts = [list(range(3, 43)), [5, 17, 99, 3, 250, 41, 8]]
    asks = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True)
    outputs = v3_engine.generate([{"prompt_token_ids": p} for p in prompts], asks, use_tqdm=False)
    assert_routed_experts_are_a_plain_forwards("deepseek_v3", prompts, outputs)


def test_the_kv_cache_holds_one_latent_a_token_and_layer(v3_engine):
    """[blocks, 16, 1, kv_lora_rank + qk_rope_head_dim] per layer, and the memory budget counts just that."""
    run = runner(v3_engine)
    mla, num_layers = run.arch.mla, run.arch.num_layers
    assert len(run.kv_caches) == num_layers
    assert [tuple(a.shape) for a in run.kv_caches[0]] == [(12, 16, 1, 16 + 8)]
    assert run.kv_cache.bytes_per_block == num_layers * 16 * mla.latent_dim * 4  # float32


def test_prefix_caching_and_preemption_give_each_requests_outputs_alone(v3_engine):
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(3, 256, n).tolist() for n in (40, 33)]
    prompts = [{"prompt_token_ids": prefixes[i % 2] + rng.integers(3, 256, int(rng.integers(1, 20))).tolist()}
               for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    engine = v3_engine.llm_engine
    before = engine.get_stats()
    together = v3_engine.generate(prompts, params, use_tqdm=False)
    stats = engine.get_stats()
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    for prompt, out in zip(prompts, together):
        assert v3_engine.reset_prefix_cache()
        alone = v3_engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, alone.token_ids)],
                                   [lp[t].logprob for lp, t in zip(alone.logprobs, alone.token_ids)], atol=1e-5)


# -- the latent attention layer against a float64 reference -------------------------------

BLOCK_SIZE, TOKEN_BUCKET, NUM_REQS = 16, 32, 5
LENGTHS = (6, 40, 75, 1)
# Per step, each request's new tokens: prefill chunks, decode-shaped single tokens and a whole
# one-token sequence side by side, contexts ending mid-block.
SCHEDULE = ({0: 5, 1: 16, 2: 11}, {0: 1, 1: 23, 2: 8}, {1: 1, 2: 30, 3: 1}, {2: 26})


def reference_mla(attn, config: ModelArchConfig, x):
    """The layer on one sequence x [L, hidden] in float64, every head's K and V expanded from the
    latents (HF's form), causal softmax, the rope on complex pairs -> [L, hidden]."""
    mla, h = config.mla, config.num_heads
    nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
    w = {name: np.asarray(module.kernel[...], np.float64) for name, module in vars(attn).items()
         if hasattr(module, "kernel")}

    def rms(v, module):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + module.eps) * np.asarray(module.weight[...], np.float64)

    def rope(v):  # [L, ..., rope]
        angles = np.arange(len(v))[:, None] * np.asarray(rope_inv_freq(config), np.float64)[None, :]
        turn = np.exp(1j * angles) * yarn_attention_factor(config.rope_scaling)
        turn = turn.reshape(len(v), *[1] * (v.ndim - 2), -1)
        half = v.shape[-1] // 2
        pairs = v[..., 0::2] + 1j * v[..., 1::2] if mla.rope_interleave else v[..., :half] + 1j * v[..., half:]
        return np.concatenate([(pairs * turn).real, (pairs * turn).imag], -1)

    x = np.asarray(x, np.float64)
    q = x @ w["q_proj"] if "q_proj" in w else rms(x @ w["q_a_proj"], attn.q_a_layernorm) @ w["q_b_proj"]
    q = q.reshape(len(x), h, -1)
    kv = x @ w["kv_a_proj_with_mqa"]
    c, k_pe = rms(kv[:, :rank], attn.kv_a_layernorm), rope(kv[:, rank:])
    w_kv = w["kv_b_proj"].reshape(rank, h, -1)
    k = np.concatenate([np.einsum("sr,rhn->shn", c, w_kv[..., :nope]),
                        np.broadcast_to(k_pe[:, None], (len(x), h, k_pe.shape[-1]))], -1)
    v = np.einsum("sr,rhv->shv", c, w_kv[..., nope:])
    q = np.concatenate([q[..., :nope], rope(q[..., nope:])], -1)
    s = np.einsum("thd,shd->hts", q, k) * config.attn_scale
    s = np.where(np.tril(np.ones((len(x), len(x)), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hts,shv->thv", p / p.sum(-1, keepdims=True), v)
    return o.reshape(len(x), -1) @ w["o_proj"]


def run_schedule(attn, config: ModelArchConfig, xs, rng):
    """Each request's tokens through the layer in SCHEDULE's ragged steps, over a latent cache of
    junk whose blocks each request holds in shuffled order. Returns each request's outputs [L, hidden];
    the padding rows must come out finite."""
    blocks = [cdiv(n, BLOCK_SIZE) for n in LENGTHS]
    num_blocks = sum(blocks) + 1
    perm = rng.permutation(num_blocks - 1)
    junk = num_blocks - 1  # what unused table entries name
    tables = np.full((len(LENGTHS), max(blocks) + 1), junk, np.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[sum(blocks[:i]):sum(blocks[:i + 1])]
    cache = jnp.asarray(rng.standard_normal((num_blocks, BLOCK_SIZE, 1, config.mla.latent_dim)), jnp.float32)
    layer = jax.jit(lambda x, cos, sin, cache, md: attn(x, cos, sin, (cache,), md, reference.ragged_paged_attention))
    done, outputs = [0] * len(LENGTHS), [[] for _ in LENGTHS]
    for step in SCHEDULE:
        reqs = sorted(step)
        x = np.zeros((TOKEN_BUCKET, xs[0].shape[1]), np.float32)
        positions, slots = np.zeros(TOKEN_BUCKET, np.int32), np.full(TOKEN_BUCKET, -1, np.int32)
        step_tables = np.full((NUM_REQS, tables.shape[1]), junk, np.int32)
        step_tables[:len(reqs)] = tables[reqs]
        qsl, seq_lens, t = [0], np.zeros(NUM_REQS, np.int32), 0
        for row, i in enumerate(reqs):
            pos = np.arange(done[i], done[i] + step[i])
            x[t:t + len(pos)], positions[t:t + len(pos)] = xs[i][pos], pos
            slots[t:t + len(pos)] = tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            t += len(pos)
            qsl.append(t)
            seq_lens[row] = done[i] + step[i]
        md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(step_tables),
                               query_start_loc=jnp.asarray(qsl + [t] * (NUM_REQS - len(reqs)), jnp.int32),
                               seq_lens=jnp.asarray(seq_lens), num_seqs=jnp.asarray([len(reqs)], jnp.int32))
        cos, sin = rope_cos_sin(config, jnp.asarray(positions))
        out, (cache,) = layer(jnp.asarray(x), cos, sin, cache, md)
        assert np.isfinite(np.asarray(out[t:])).all(), "a padding row is not finite"
        for row, i in enumerate(reqs):
            outputs[i].append(np.asarray(out[qsl[row]:qsl[row + 1]]))
            done[i] += step[i]
    assert done == list(LENGTHS)
    return [np.concatenate(o) for o in outputs]


@pytest.mark.parametrize("name", MODELS)
def test_latent_attention_over_ragged_paged_batches_equals_the_expanded_float64_reference(name):
    """Both prefill forms = every head's own K and V: absorbed queries and outputs over the latent
    cache, and the step's tokens expanded merged with the cached context absorbed; for prefill chunks
    with and without cached context, decode tokens and a one-token sequence in one batch, beside
    padding rows and request slots (V2: no q LoRA; V3: q LoRA)."""
    config, model, _ = load_fixture(name)
    attn = model.layers[1].self_attn
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n, config.hidden_size)).astype(np.float32) for n in LENGTHS]
    got = {}
    for form in PREFILL_FORMS:
        attn.prefill = form  # (a model built under JAXLLM_MLA_PREFILL=form)
        got[form] = run_schedule(attn, config, xs, copy.deepcopy(rng))  # the same cache and tables
    for i, x in enumerate(xs):
        want = reference_mla(attn, config, x)
        for form in PREFILL_FORMS:
            np.testing.assert_allclose(got[form][i], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{form}: request {i}")
        np.testing.assert_allclose(got["expanded"][i], got["absorbed"][i], rtol=1e-5, atol=1e-6 * np.abs(want).max())


# -- configs ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, num_params, num_active", [("deepseek-v2-lite", 15.7e9, 2.4e9),
                                                           ("deepseek-v3", 671e9, 37e9)])
def test_bundled_configs_have_their_models_sizes(name, num_params, num_active):
    """The published sizes: all params, and those a token reads (top_k of the routed experts, one
    row of the embedding)."""
    config = EngineArgs(model=name, load_format="dummy").create_config().model.arch
    _, params = abstract_params(config, jnp.bfloat16)
    sizes = {path: int(np.prod(var.shape)) for path, var in params.items()}
    routed = sum(size for path, size in sizes.items() if "experts" in path and "shared_experts" not in path)
    total = sum(sizes.values())
    assert total == pytest.approx(num_params, rel=0.01)
    active = total - routed * (1 - config.moe.top_k / config.moe.num_experts) - sizes[("embed_tokens", "embedding")]
    assert active == pytest.approx(num_active, rel=0.03)


@pytest.mark.parametrize("name, change, message", [
    ("deepseek_v2", dict(topk_method="noaux_tc"), "'topk_method' must be one of"),
    ("deepseek_v2", dict(norm_topk_prob=True), "'norm_topk_prob' must be false"),
    ("deepseek_v2", dict(n_group=3), "'n_group' \\(3\\) must divide the 8 experts"),
    ("deepseek_v3", dict(topk_group=5), "'topk_group' \\(5\\) must be in \\[1, n_group"),
    ("deepseek_v3", dict(scoring_func="softmax"), "'scoring_func' must be 'sigmoid'"),
    ("deepseek_v3", dict(moe_layer_freq=2), "'moe_layer_freq' must be 1"),
    ("deepseek_v3", dict(kv_lora_rank=None), "missing the required key\\(s\\) \\['kv_lora_rank'\\]"),
    ("deepseek_v3", dict(qk_rope_head_dim=7), "'qk_rope_head_dim' must be even"),
])
def test_bad_config_keys_are_a_clear_error_naming_the_key(name, change, message):
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config({**fixture_hf_config(name), **change})


@pytest.mark.parametrize("name", MODELS)
def test_v3_checkpoints_multi_token_prediction_layer_is_skipped_and_nothing_else(name):
    """model.layers.3 of a 3-layer model: V3's multi-token prediction module, an unexpected tensor in V2."""
    config = ModelArchConfig.from_hf_config(fixture_hf_config(name))
    _, params = abstract_params(config, jnp.float32)
    weights = [*iter_hf_weights(tiny_model(name)), ("model.layers.3.eh_proj.weight", np.zeros((32, 64), np.float32))]
    if name == "deepseek_v3":
        assert {path for path, _ in checkpoint_params(config, params, weights)} == set(params)
    else:
        with pytest.raises(ValueError, match="unexpected tensor 'model.layers.3.eh_proj.weight'"):
            list(checkpoint_params(config, params, weights))


def test_ngram_drafts_on_the_device_keep_hfs_greedy_tokens_and_logprobs():
    """The drafts' positions moved back on the device over the ones rejected, through the latent cache;
    then a prompt that repeats, whose drafts the model takes."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(tiny_model("deepseek_v3"), **TIGHT_ENGINE, speculative_config=spec) as llm:
        assert_greedy_is_hfs(llm, "deepseek_v3")
        stats = llm.llm_engine.get_stats()
        assert llm.llm_engine.config.drafts_on_device and stats["spec_decode_num_drafts"] > 0
        golden = np.load(os.path.join(tiny_model("deepseek_v3"), "golden.npz"))
        repeated = {"prompt_token_ids": (golden["greedy_prompt"].tolist() + golden["greedy_tokens"].tolist()) * 2}
        llm.generate([repeated], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("args, message", [
    (dict(attention_backend="mosaic"), "has no latent-attention kernel"),
    (dict(speculative_config={"method": "draft_model", "model": tiny_model("llama"), "num_speculative_tokens": 2}),
     "'draft_model' does not run with the deepseek_v3 model"),
])
def test_engine_args_latent_attention_cannot_take_are_a_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model("deepseek_v3"), **args).create_config()


def test_latent_attention_runs_on_the_pallas_kernel_on_a_gpu_and_the_reference_elsewhere():
    for devices, backend in ((DeviceFacts("gpu", 1, "mosaic"), "pallas"), (DeviceFacts("cpu", 1, "reference"), "reference")):
        assert EngineArgs(model=tiny_model("deepseek_v2")).create_config(devices).attention_backend == backend


# -- tensor parallelism -------------------------------------------------------------------

@needs_2
@pytest.mark.parametrize("form", PREFILL_FORMS)
def test_tensor_parallel_gives_hfs_greedy_tokens_and_logprobs_with_the_latent_cache_on_every_device(form):
    with build_with(form, lambda: LLM(tiny_model("deepseek_v2"), tensor_parallel_size=2, **ENGINE)) as llm:
        assert_greedy_is_hfs(llm, "deepseek_v2")
        cache = runner(llm).kv_caches[0][0]
        assert cache.sharding.is_fully_replicated
        kv_b = runner(llm).weights.model().layers[0].self_attn.kv_b_proj.kernel[...]
        assert kv_b.addressable_shards[0].data.shape == (16, 8 * (8 + 12) // 2)  # 4 of the 8 heads


def test_tensor_parallel_over_two_forced_devices():
    """The test above, in a child process with 2 forced host devices."""
    if jax.device_count() >= 2:
        pytest.skip("this process has the devices: the test above runs here")
    run_with_host_devices(__file__, "tensor_parallel_gives", 2, "2 passed", timeout_s=600)
