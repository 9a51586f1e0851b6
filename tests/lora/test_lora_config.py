"""enable_lora's engine arguments checked when the Config is made, each error naming its field."""
import pytest

from jaxllm.cli import main
from jaxllm.config import EngineArgs
from tests.conftest import tiny_model


def config(model="llama", **fields):
    return EngineArgs(model=tiny_model(model), enable_lora=True, **fields).create_config()


def test_lora_config_defaults_are_vllms():
    lora = config().lora
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (1, 16, 1)
    assert config(max_loras=3).lora.max_cpu_loras == 3
    assert EngineArgs(model=tiny_model("llama")).create_config().lora is None


@pytest.mark.parametrize("model, fields, message", [
    ("llama", dict(max_loras=0), "max_loras must be an int >= 1, got 0"),
    ("llama", dict(max_lora_rank=0), "max_lora_rank must be an int >= 1, got 0"),
    ("llama", dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras must be an int >= max_loras \(2\), got 1"),
    ("gemma3", {}, "enable_lora runs the Llama-family models .* not 'gemma3'"),
    ("qwen3_moe", {}, "enable_lora runs the Llama-family models .* not 'qwen3_moe'"),
    ("llama", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "enable_lora does not run with speculative_config yet"),
    ("llama", dict(runner="pooling"), "enable_lora does not run with runner='pooling' yet"),
])
def test_a_bad_lora_config_names_its_field(model, fields, message):
    with pytest.raises(ValueError, match=message):
        config(model, **fields)


def test_serve_lora_modules_without_enable_lora_is_a_one_line_error(capsys):
    assert main(["serve", tiny_model("llama"), "--lora-modules", "a=/adapters/a"]) == 2
    assert capsys.readouterr().err == "jaxllm: error: --lora-modules needs --enable-lora\n"
