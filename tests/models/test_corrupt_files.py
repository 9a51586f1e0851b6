"""A corrupt model file raises a ValueError that names the file (and the key, for a
config.json), instead of the reader's raw error."""
import json
import os
import re

import gguf
import numpy as np
import pytest

from jaxllm import EngineArgs
from jaxllm.models.gguf import find_default_model, load_gguf_config
from tests.conftest import tiny_model, write_gguf_metadata


def smollm2_head(num_bytes: int) -> bytes:
    with open(find_default_model(), "rb") as f:
        return f.read(num_bytes)


def header_bytes() -> int:
    """Bytes of the SmolLM2 GGUF before its tensor data (the metadata and the tensor list)."""
    return gguf.GGUFReader(find_default_model()).data_offset


# name -> the file's content, made when the test runs
CORRUPT_GGUFS = {
    "empty": lambda: b"",
    "first 4 KB": lambda: smollm2_head(4096),
    "header without the tensor data": lambda: smollm2_head(header_bytes() + 1000),
    "random bytes": lambda: np.random.default_rng(0).bytes(4096),
    "the magic, then garbage": lambda: b"GGUF" + np.random.default_rng(1).bytes(4092),
    "the magic and version, then garbage": lambda: smollm2_head(8) + np.random.default_rng(2).bytes(4088),
}


@pytest.mark.parametrize("name", CORRUPT_GGUFS)
def test_corrupt_gguf_raises_naming_the_file(tmp_path, name):
    path = tmp_path / "model.gguf"
    path.write_bytes(CORRUPT_GGUFS[name]())
    message = f"{re.escape(str(path))} is not a readable GGUF file"
    with pytest.raises(ValueError, match=message):
        load_gguf_config(str(path))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(path)).create_config()


def test_gguf_without_a_required_key_raises_naming_it(tmp_path):
    path = tmp_path / "no_layers.gguf"
    write_gguf_metadata(path, {"llama.embedding_length": 64})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: the GGUF metadata lacks llama.attention.head_count"):
        load_gguf_config(str(path))


def test_gguf_with_zero_attention_heads_raises_naming_the_key(tmp_path):
    path = tmp_path / "no_heads.gguf"
    write_gguf_metadata(path, {"llama.embedding_length": 64, "llama.attention.head_count": 0})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: llama.attention.head_count must be >= 1, got 0"):
        load_gguf_config(str(path))


def tiny_config() -> dict:
    with open(os.path.join(tiny_model("llama"), "config.json")) as f:
        return json.load(f)


def without(key: str) -> dict:
    config = tiny_config()
    del config[key]
    return config


# name -> (config.json's content, what the error says after the path)
CORRUPT_CONFIGS = {
    "not JSON": ('{"vocab_size": 256,', "is not valid JSON"),
    "not UTF-8": (b"\xff\xfe{}", "is not valid JSON"),
    "empty": ("", "is not valid JSON"),
    "a list": ("[1, 2]", ": must hold a JSON object, got list"),
    "no vocab_size": (without("vocab_size"), r": missing the required key\(s\) \['vocab_size'\]"),
    "null hidden_size": ({**tiny_config(), "hidden_size": None}, r"\['hidden_size'\]"),
    "a string vocab_size": ({**tiny_config(), "vocab_size": "256"}, ": config key 'vocab_size' must be an int, got '256'"),
    "a float num_hidden_layers": ({**tiny_config(), "num_hidden_layers": 2.0}, "'num_hidden_layers' must be an int"),
    "a bool head_dim": ({**tiny_config(), "head_dim": True}, "'head_dim' must be an int, got True"),
    "a string rms_norm_eps": ({**tiny_config(), "rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a number"),
    "a string tie_word_embeddings": ({**tiny_config(), "tie_word_embeddings": "false"}, "'tie_word_embeddings' must be a bool"),
    "a string rope_parameters": ({**tiny_config(), "rope_parameters": "llama3"}, "'rope_parameters' must be an object"),
    "no KV heads": ({**tiny_config(), "num_key_value_heads": 0}, "config key 'num_key_value_heads' must be >= 1, got 0"),
    "no heads, no head_dim": ({**without("head_dim"), "num_attention_heads": 0},
                              "config key 'num_attention_heads' must be >= 1, got 0"),
    "heads not a multiple of KV heads": ({**tiny_config(), "num_key_value_heads": 3},
                                         r"'num_attention_heads' \(4\) must be a multiple of 'num_key_value_heads' \(3\)"),
}


@pytest.mark.parametrize("name", CORRUPT_CONFIGS)
def test_corrupt_config_json_raises_naming_the_file_and_the_key(tmp_path, name):
    content, expected = CORRUPT_CONFIGS[name]
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + expected):
        EngineArgs(model=str(tmp_path)).create_config()
