"""Mamba2 (models/mamba2.py) on CPU: against HF transformers' fp32 outputs for the tiny random
Mamba2 in tests/fixtures/tiny/mamba2 (scripts/make_fixtures.py), whole prompts and in chunks, and
through the engine: greedy tokens, logprobs, prompt logprobs of chunked prefills, and the state
slots through waiting, pauses that preempt, aborts and reuse."""
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fp8 import Fp8Linear
from jaxllm.models.loader import abstract_params, create_model, iter_hf_weights
from jaxllm.sharding import make_mesh
from jaxllm.worker.executables import FORWARD
from tests.conftest import tiny_model
from tests.models.state_checks import (ATOL, assert_chunked_prompt_logprobs_are_hfs, chunked_logits,
                                       hf_prompt_logprobs, run_through_aborts_and_a_pause)
from tests.models.test_moe import assert_greedy_is_hfs

pytestmark = pytest.mark.usefixtures("warm_up_every_engine")

MODEL = tiny_model("mamba2")
GOLDEN = np.load(os.path.join(MODEL, "golden.npz"))
# 3 state slots for up to 4 running requests: a request waits for a slot; the budget chunks prompts.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=3,
              skip_tokenizer_init=True, show_progress=False, enable_multiprocessing=False)


def hf_config() -> dict:
    with open(os.path.join(MODEL, "config.json")) as f:
        return json.load(f)


def make_model_step():
    """The model with the checkpoint's weights, one jitted step over a 128-token bucket and 2
    requests (one padding), and a maker of 4 state slots (the step donates them)."""
    config = ModelArchConfig.from_hf_config(hf_config())
    model = create_model(config, dtype=jnp.float32, mesh=make_mesh(1), weights=iter_hf_weights(MODEL))
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(states, input_ids, md):
        m = nnx.merge(graphdef, state)
        hidden, states = m(input_ids, jnp.zeros_like(input_ids), states, md, None)
        return m.compute_logits(hidden), states

    m = config.mamba
    return step, lambda: [tuple(jnp.zeros((4, *shape)) for shape in m.state_shapes) for _ in range(config.num_layers)]


@pytest.fixture(scope="module")
def model_step():
    return make_model_step()


@pytest.mark.parametrize("length, chunks", [(1, [1]), (7, [7]), (33, [33]), (100, [100]), (7, [1, 1, 5]),
                                            (33, [15, 1, 17]), (100, [40, 3, 57])])
def test_logits_match_hf_transformers_whole_and_in_chunks(model_step, length, chunks):
    """Chunks that continue from the states the one before left in slot 2, across the SSD's 16-token chunks."""
    assert_chunks_give_hfs_logits(model_step, length, chunks)


def test_the_pallas_ssd_kernel_gives_hfs_logits(monkeypatch):
    """JAXLLM_SSD_KERNEL=pallas: the chunk terms from kernels/pallas_ssd.py (interpreted here)."""
    monkeypatch.setenv("JAXLLM_SSD_KERNEL", "pallas")
    assert_chunks_give_hfs_logits(make_model_step(), 100, [40, 3, 57])


def assert_chunks_give_hfs_logits(model_step, length: int, chunks: list[int]) -> None:
    step, make_states = model_step
    logits = chunked_logits(step, make_states(), GOLDEN[f"prompt_{length}"], chunks,
                            lambda start, n: np.full((1, 128), -1, np.int32), np.array([[[2], [0]]], np.int32))
    np.testing.assert_allclose(logits, GOLDEN[f"logits_{length}"], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, **ENGINE) as llm:
        yield llm


def test_greedy_tokens_and_logprobs_match_hf_and_nothing_compiles_after_warm_up(llm):
    before = llm.llm_engine.get_stats()["num_compilations"]
    assert_greedy_is_hfs(llm, "mamba2")
    assert llm.llm_engine.get_stats()["num_compilations"] == before


def test_the_pallas_state_update_gives_hfs_greedy_tokens_and_logprobs(monkeypatch):
    """JAXLLM_SSD_UPDATE=pallas: decode steps update the states in place in kernels/pallas_ssd.py's kernel
    (interpreted here)."""
    monkeypatch.setenv("JAXLLM_SSD_UPDATE", "pallas")
    with LLM(MODEL, **ENGINE) as llm:
        assert_greedy_is_hfs(llm, "mamba2")


def test_chunked_prefills_of_any_split_give_hfs_prompt_logprobs(llm):
    """The 100-token prompt in chunks of the 32-token budget, alone and behind other requests that
    move its chunks' boundaries; the 33-token one likewise."""
    assert_chunked_prompt_logprobs_are_hfs(llm, GOLDEN, ([], [3], [20, 9], [30]))


def test_waiting_preemption_and_aborts_leave_every_state_slot_free_and_the_others_outputs(llm):
    """Six requests on three slots: some wait for a slot another frees; two are aborted; a pause that
    keeps the requests preempts every running one, which recomputes from scratch. The golden prompt's
    tokens stay HF's, the others' what each gives alone, and every slot ends free."""
    before, stats = run_through_aborts_and_a_pause(llm, GOLDEN, (40, 5, 61, 17, 9),
                                                   lambda stats: stats["num_free_blocks"] == stats["num_blocks"])
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["num_free_blocks"] == stats["num_blocks"] == 3 and stats["num_cached_blocks"] == 0


def test_no_forward_has_a_conditional_and_decode_steps_take_the_decodes_only_forward(llm):
    """No layer of any forward branches on the device (on a GPU XLA's conditional waits on the host
    for its branch index): a step with a prefill chunk runs the chunk scan over its bucket's windows,
    a step whose requests have one token each its bucket's decodes-only forward, the update alone.
    The goldens above pass through both."""
    runner = llm.llm_engine.engine_core.core.executor.runner
    assert runner.token_buckets == [16, 32] and runner.decodes_only_buckets == [16]  # 4 requests fit 16
    conditionals = {str(key): compiled.as_text().count(" conditional(")
                    for key, compiled in runner.executables.compiled.items() if key.kind == FORWARD}
    assert conditionals == {"forward 16": 0, "forward 16 decodes only": 0, "forward 32": 0}
    taken = []
    get = runner.executables.get
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner.executables, "get", lambda key, lower: taken.append(str(key)) or get(key, lower))
        llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7]}, {"prompt_token_ids": [9, 8]}],
                     SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    forwards = [name for name in taken if name.startswith("forward")]
    assert forwards == ["forward 16"] + ["forward 16 decodes only"] * 3


def test_no_forward_copies_a_state_cache(llm):
    """Each layer reads its state caches once and then writes them in place: a second read beside the
    write made XLA copy the whole cache first, and the result back into the donated buffer after: the
    conv inputs in every step, the SSM states in a step with a prefill (at Mamba2-2.7B's 256 slots,
    0.67 GB a layer, both ways)."""
    runner = llm.llm_engine.engine_core.core.executor.runner
    cache_shapes = {f"{a.dtype.name.replace('float', 'f')}{list(a.shape)}".replace(" ", "")
                    for a in jax.tree.leaves(runner.kv_caches)}
    assert cache_shapes == {"f32[3,8,8,16]", "f32[3,3,64]"}  # the SSM states, the conv's inputs
    for key, compiled in runner.executables.compiled.items():
        if key.kind == FORWARD:
            text = compiled.as_text()
            params = re.findall(r"(%\S+) = (\w+\[[\d,]*\])\{[\d,]*\} parameter\(", text)
            caches = [name for name, shape in params if shape in cache_shapes]
            assert len(caches) >= 3 * runner.arch.num_layers  # (and the parameters of the computations within)
            copied = [name for name in caches if f" copy({name})" in text]
            assert not copied, f"{key} copies {copied}"


def test_bundled_mamba2_2_7b_has_its_size():
    config = EngineArgs(model="mamba2-2.7b", load_format="dummy").create_config()
    assert not config.cache.enable_prefix_caching
    _, params = abstract_params(config.model.arch, jnp.bfloat16)
    assert sum(int(np.prod(var.shape)) for var in params.values()) == pytest.approx(2.7e9, rel=0.01)


@pytest.mark.parametrize("change, message", [
    ({"n_groups": 3}, "'n_groups' \\(3\\) must divide 'num_heads'"),
    ({"state_size": None}, "'state_size'"),
    ({"num_heads": 4}, "'num_heads' \\* 'head_dim'"),
    ({"conv_kernel": "4"}, "'conv_kernel' must be of type int"),
])
def test_a_bad_mamba2_config_names_its_key(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config({**hf_config(), **change})


@pytest.mark.parametrize("args, message", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(batch_invariant=True), "batch_invariant"),
])
def test_engine_args_a_mamba2_model_cannot_take_are_a_clear_error(args, message):
    with pytest.raises(ValueError, match=f"model does not run with {message}"):
        EngineArgs(model=MODEL, **args).create_config()


def fp8_logprob_error(llm, model: str, engine: dict, prompt: list[int]) -> tuple[np.ndarray, set[str]]:
    """Teacher-forced on `prompt`: |logprob| of each token after the first under quantization="fp8"
    against `llm` (the unquantized engine of `model`), and the names of the fp8 engine's e4m3 Linears
    (the first layer's)."""
    forced = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(engine):
        out = engine.generate([{"prompt_token_ids": prompt}], forced, use_tqdm=False)[0]
        return np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    with LLM(model, quantization="fp8", **engine) as fp8:
        layer = fp8.llm_engine.engine_core.core.executor.runner.weights.model().layers[0]
        names = {str(path[-1]) for path, module in nnx.iter_modules(layer) if isinstance(module, Fp8Linear)}
        return np.abs(logprobs(fp8) - logprobs(llm)), names


def test_fp8_quantizes_the_projections_and_keeps_the_prompt_logprobs_close(llm):
    """quantization="fp8": zxdt_proj, bc_proj and out_proj in e4m3 (the conv and the SSM's params stay);
    teacher-forced on the 100-token prompt, its logprobs within e4m3's reach of the unquantized ones."""
    error, quantized = fp8_logprob_error(llm, MODEL, ENGINE, GOLDEN["prompt_100"].tolist())
    assert quantized == {"zxdt_proj", "bc_proj", "out_proj"}
    assert error.mean() < 0.06 and error.max() < 0.2, (error.mean(), error.max())  # 0.029 and 0.12 measured


def test_the_plain_logprobs_function_gives_hfs(llm):
    """LLM.get_logprobs_fn (a trainer's view: the model over its own zero states) on the 33-token prompt."""
    fn = jax.jit(llm.get_logprobs_fn())
    logprobs = np.asarray(fn(llm.get_params(), jnp.asarray(GOLDEN["prompt_33"], jnp.int32)))
    np.testing.assert_allclose(logprobs, hf_prompt_logprobs(GOLDEN, 33), atol=ATOL, rtol=0)


def test_a_budget_too_small_for_the_scan_names_the_settings_that_size_it(monkeypatch):
    """The SSD scan's room grows with the step's tokens and requests, not with max_model_len."""
    from jaxllm.worker.kv_cache import KVCache
    monkeypatch.setattr(KVCache, "_num_blocks", lambda self: 0)  # as on a card the scan's estimate fills
    with pytest.raises(ValueError, match=r"the KV cache has 0 blocks.*a Mamba layer's scan keeps [0-9.]+ GiB for a "
                                         r"step of max_num_batched_tokens=32 and max_num_seqs=4: lower those"):
        LLM(tiny_model("mamba2"), **{**ENGINE, "num_gpu_blocks_override": None})


def test_mamba2_2_7b_at_the_gpu_defaults_keeps_a_state_slot_per_request_on_an_80_gb_card(monkeypatch):
    """The budget's reserve for the SSD scan (kernels/ssd.py scan_bytes) leaves room for the states of
    max_num_seqs requests beside the 2.7B weights, at 8192 batched tokens and 256 requests."""
    from jaxllm.models.kv_layout import model_kv_layout
    from jaxllm.worker import kv_cache

    class Card:  # an H100 80GB, the weights on it
        process_index = 0

        def memory_stats(self):
            return {"bytes_limit": int(79.2 * 2**30), "bytes_in_use": int(2.7e9 * 2)}

    config = EngineArgs(model="mamba2-2.7b", load_format="dummy", max_num_batched_tokens=8192,
                        max_num_seqs=256).create_config()
    monkeypatch.setattr(kv_cache.jax, "local_devices", lambda: [Card()])
    arch = config.model.arch
    cache = kv_cache.KVCache(config, arch, model_kv_layout(arch), make_mesh())
    assert cache.num_blocks == 256
