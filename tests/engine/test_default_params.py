"""Default sampling params from the model: as vLLM's
get_default_sampling_params, the model's generation_config.json or GGUF metadata sets the
sampling fields a caller who passes no SamplingParams gets."""
import json
import os
import shutil

import gguf
import pytest

from jaxllm import LLM, EngineArgs, SamplingParams
from jaxllm.tokenizer import default_sampling_fields
from tests.conftest import tiny_model, write_gguf_metadata
from tests.engine.test_core_process import engine_args

pytestmark = pytest.mark.timeout(300)  # a hung step loop fails the test, never the CI run

# Greedy, so the outputs are comparable; do_sample is not read (as vLLM: a temperature of 0 is greedy).
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.0, "top_p": 0.9,
                     "top_k": 20, "min_p": 0.05, "max_new_tokens": 5, "repetition_penalty": 1.3}
MODEL_DEFAULTS = SamplingParams(temperature=0.0, top_p=0.9, top_k=20, min_p=0.05, max_tokens=5,
                                repetition_penalty=1.3)


def model_folder(char_llama: str, folder, generation_config: dict) -> str:
    shutil.copytree(char_llama, folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation_config, f)
    return str(folder)


def start(model: str) -> LLM:
    # The shapes of tests/engine/test_core_process.py's engines: their executables are cached.
    return LLM(**vars(engine_args(model, enable_multiprocessing=False)), show_progress=False)


@pytest.fixture(scope="module")
def llm(char_llama, tmp_path_factory):
    with start(model_folder(char_llama, tmp_path_factory.mktemp("generation_config"), GENERATION_CONFIG)) as llm:
        yield llm


def test_get_default_sampling_params_reads_the_models_generation_config(llm):
    assert llm.get_default_sampling_params() == MODEL_DEFAULTS
    assert llm.get_default_sampling_params() is not llm.get_default_sampling_params()  # each caller its own


def test_generate_without_sampling_params_uses_the_models_defaults(llm):
    prompts = ["The sea", "A cat sat"]
    got = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, MODEL_DEFAULTS, use_tqdm=False)
    # max_new_tokens (5), not SamplingParams' 16; the tiny model may end one early with EOS.
    assert all(len(o.outputs[0].token_ids) <= 5 for o in got)
    assert any(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5 for o in got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in explicit]


def test_passed_sampling_params_win_over_the_models_defaults(llm):
    (out,) = llm.generate("The sea", SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 9


def test_a_model_without_sampling_keys_gets_the_plain_defaults():
    # The tiny llama's generation_config.json holds only token ids; the embedded GGUF no general.sampling.*.
    for model in (tiny_model("llama"), None):
        assert default_sampling_fields(EngineArgs(model=model).create_config().model) == {}


def test_a_bad_value_in_generation_config_raises_naming_the_field_and_the_model(char_llama, tmp_path):
    folder = model_folder(char_llama, tmp_path / "bad", {"eos_token_id": 2, "top_p": 0.0})
    with start(folder) as llm:
        with pytest.raises(ValueError, match=f"{folder}.*top_p must be in"):
            llm.get_default_sampling_params()
        (out,) = llm.generate("The sea", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3  # passed params still serve


def test_gguf_general_sampling_keys_set_the_defaults(tmp_path):
    file = tmp_path / "sampling.gguf"

    def sampling_keys(writer):
        writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.7)
        writer.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.95)
        writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 40)
        writer.add_float32(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, 1.1)  # no field for it yet
    write_gguf_metadata(file, extra=sampling_keys)
    model = EngineArgs(model=str(file), load_format="dummy").create_config().model
    assert default_sampling_fields(model) == {"temperature": 0.7, "top_p": 0.95, "top_k": 40}
