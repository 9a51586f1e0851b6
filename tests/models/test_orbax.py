"""orbax checkpoints: `jaxllm convert` writes one, restore_model reads it back
straight into the mesh's shardings, and a mismatched or corrupt one is a clear error."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.cli import main
from jaxllm.config import EngineArgs
from jaxllm.models.gguf import find_default_model, load_gguf_tokenizer
from jaxllm.models.loader import create_model, iter_hf_weights
from jaxllm.models.orbax_checkpoint import PARAMS_DIR, restore_model, save_model
from jaxllm.sharding import make_mesh, named_sharding
from tests.conftest import run_with_host_devices, tiny_model

pytestmark = pytest.mark.timeout(300)


def hf_model(name="llama", dtype=jnp.float32, tp=1):
    arch = EngineArgs(model=tiny_model(name)).create_config().model.arch
    return arch, create_model(arch, dtype=dtype, mesh=make_mesh(tp), weights=iter_hf_weights(tiny_model(name)))


def flat_params(model) -> dict:
    return {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, char_llama) -> str:
    """The tiny Llama (with a character tokenizer) converted by the CLI, in float32."""
    dst = str(tmp_path_factory.mktemp("orbax") / "tiny-llama")
    assert main(["convert", char_llama, dst, "--dtype", "float32"]) == 0
    return dst


def test_convert_writes_params_config_and_tokenizer(converted, char_llama):
    assert os.path.isdir(os.path.join(converted, PARAMS_DIR))
    with open(os.path.join(converted, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(char_llama, "config.json")) as f:
        source = json.load(f)
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == source["num_hidden_layers"]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir(converted))


def test_a_converted_folder_is_an_orbax_model(converted):
    mc = EngineArgs(model=converted).create_config().model
    assert mc.format == "orbax" and mc.arch == EngineArgs(model=tiny_model("llama")).create_config().model.arch


def test_restored_params_equal_the_original(converted):
    arch, original = hf_model()
    restored = restore_model(converted, arch, dtype=jnp.float32, mesh=make_mesh(1))
    want, got = flat_params(original), flat_params(restored)
    assert want.keys() == got.keys()
    for path, value in want.items():
        assert got[path].dtype == jnp.float32 and np.array_equal(got[path], value), path


def test_restore_casts_to_the_engine_dtype(converted):
    arch, original = hf_model()
    restored = flat_params(restore_model(converted, arch, dtype=jnp.bfloat16, mesh=make_mesh(1)))
    for path, value in flat_params(original).items():
        assert restored[path].dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(restored[path], np.float32), np.asarray(value.astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("saved_tp, restored_tp", [(1, 2), (2, 1), (2, 2)])
def test_sharded_restore_places_each_param_by_the_rules(tmp_path, saved_tp, restored_tp):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices: test_sharded_restores_over_two_devices runs it in a process with 2")
    arch, original = hf_model(tp=saved_tp)
    save_model(original, str(tmp_path))
    mesh = make_mesh(restored_tp)
    restored = restore_model(str(tmp_path), arch, dtype=jnp.float32, mesh=mesh)
    want = flat_params(original)
    for path, var in nnx.to_flat_state(nnx.state(restored)):
        value = var.get_value()
        assert value.sharding == named_sharding(mesh, var.get_metadata()["out_sharding"]), path
        assert np.array_equal(value, want[path]), path
    qkv = restored.layers[0].self_attn.qkv_proj.kernel.get_value()  # [embed, qkv]: no device holds it whole
    assert {s.data.shape for s in qkv.addressable_shards} == {(arch.hidden_size, qkv.shape[1] // restored_tp)}


def test_sharded_restores_over_two_devices():
    """The test above, in a child process with 2 forced host devices (this one has 1)."""
    if jax.device_count() >= 2:
        pytest.skip("this process has the devices: the test above runs here")
    run_with_host_devices(__file__, "test_sharded_restore_places_each_param_by_the_rules", 2, "3 passed",
                          timeout_s=240)


def test_a_checkpoint_that_does_not_match_its_config_is_a_clear_error(converted):
    arch, _ = hf_model()
    with pytest.raises(ValueError, match=r"does not match the model .*missing: layers\.2\."):
        restore_model(converted, type(arch)(**{**arch.__dict__, "num_layers": 3}), dtype=jnp.float32,
                      mesh=make_mesh(1))
    with pytest.raises(ValueError, match=r"wrong shape: layers\.0\.mlp\.down_proj\.kernel"):
        restore_model(converted, type(arch)(**{**arch.__dict__, "intermediate_size": 2 * arch.intermediate_size}),
                      dtype=jnp.float32, mesh=make_mesh(1))


def test_a_corrupt_checkpoint_is_a_clear_error(tmp_path):
    arch, original = hf_model()
    save_model(original, str(tmp_path))
    data = os.path.join(tmp_path, PARAMS_DIR, "ocdbt.process_0", "d")
    for name in os.listdir(data):
        with open(os.path.join(data, name), "r+b") as f:
            f.truncate(7)
    with pytest.raises(ValueError, match="cannot be restored"):
        restore_model(str(tmp_path), arch, dtype=jnp.float32, mesh=make_mesh(1))


def test_a_folder_without_params_is_a_clear_error(tmp_path):
    arch, _ = hf_model()
    (tmp_path / PARAMS_DIR).mkdir()
    with pytest.raises(ValueError, match="not a readable orbax checkpoint"):
        restore_model(str(tmp_path), arch, dtype=jnp.float32, mesh=make_mesh(1))


def test_convert_into_a_folder_that_is_not_empty_exits_2(tmp_path, capsys):
    (tmp_path / "something").write_text("")
    assert main(["convert", tiny_model("llama"), str(tmp_path)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err


def test_convert_a_gguf_keeps_its_tokenizer_and_chat_template(tmp_path):
    gguf = find_default_model()
    dst = str(tmp_path / "smollm2")
    assert main(["convert", gguf, dst]) == 0
    from transformers import AutoTokenizer
    saved, original = AutoTokenizer.from_pretrained(dst), load_gguf_tokenizer(gguf)
    text = "The capital of France is Paris. 1234 ²³ <|im_end|>"
    assert saved.encode(text) == original.encode(text)
    assert saved.chat_template == original.chat_template and saved.chat_template
    mc = EngineArgs(model=dst).create_config().model
    assert mc.format == "orbax" and mc.hf_config["dtype"] == "bfloat16"
    assert mc.hf_config["eos_token_id"] == EngineArgs(model=gguf).create_config().model.hf_config["eos_token_id"]


def test_an_orbax_model_generates_what_its_source_generates(converted, char_llama):
    from jaxllm import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = []
    for model in (char_llama, converted):
        with LLM(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=16,
                 show_progress=False, enable_multiprocessing=False) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(["abc", "hello"], params, use_tqdm=False)])
    assert outputs[0] == outputs[1] and all(outputs[0])
