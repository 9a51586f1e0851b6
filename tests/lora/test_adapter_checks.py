"""A PEFT adapter's files checked at the boundary (jaxllm/lora/adapter.py), without an engine:
each broken adapter raises a ValueError naming its file and the field at fault."""
import os

import numpy as np
import pytest

from jaxllm.lora.adapter import check_adapter, read_adapter
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.lora import lora_module_dims
from tests.conftest import tiny_model
from tests.lora.adapters import MAX_LORA_RANK, write_adapter


@pytest.fixture(scope="module")
def arch():
    import json
    with open(os.path.join(tiny_model("llama"), "config.json")) as f:
        return ModelArchConfig.from_hf_config(json.load(f))


def check(path, arch):
    return check_adapter(str(path), MAX_LORA_RANK, lora_module_dims(arch), arch.num_layers)


def test_a_good_adapter_passes_with_its_scaling(tmp_path, arch):
    spec = check(write_adapter(tmp_path / "a", r=4), arch)
    assert spec.rank == 4 and spec.scaling == 2.0 and len(spec.tensors) == 2 * 2 * 2
    rslora = check(write_adapter(tmp_path / "b", r=4, use_rslora=True), arch)
    assert rslora.scaling == 8 / 2  # lora_alpha / sqrt(r)


@pytest.mark.parametrize("make, message", [
    (lambda d: write_adapter(d, r=32), r"adapter_config.json: r=32 exceeds max_lora_rank \(16"),
    (lambda d: write_adapter(d, targets=("q_proj", "lm_head")), r"target_modules \['lm_head'\] are not supported"),
    (lambda d: write_adapter(d, shapes={"1.self_attn.q_proj.lora_B": (64, 3)}),
     r"adapter_model.safetensors: tensor '.*layers.1.self_attn.q_proj.lora_B.weight' has shape \[64, 3\], "
     r"expected \[64, 4\]"),
    (lambda d: write_adapter(d, use_dora=True), r"use_dora=True: DoRA adapters are not supported"),
    (lambda d: write_adapter(d, r=0), r"r must be an int >= 1, got 0"),
])
def test_a_broken_adapter_names_its_file_and_field(tmp_path, arch, make, message):
    with pytest.raises(ValueError, match=message):
        check(make(tmp_path / "bad"), arch)


def test_missing_files_are_named(tmp_path, arch):
    with pytest.raises(ValueError, match="is not a folder"):
        check(tmp_path / "nowhere", arch)
    folder = write_adapter(tmp_path / "a")
    os.remove(os.path.join(folder, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        check(folder, arch)


def test_a_slot_takes_a_transposed_and_b_scaled_and_padded(tmp_path, arch):
    from safetensors.numpy import load_file
    folder = write_adapter(tmp_path / "a", r=4)
    spec = check(folder, arch)
    weights = read_adapter(spec, MAX_LORA_RANK, lora_module_dims(arch), arch.num_layers)
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    a, b = weights.modules["v_proj"]
    assert a.shape == (2, 64, MAX_LORA_RANK) and b.shape == (2, MAX_LORA_RANK, 32)
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    np.testing.assert_array_equal(a[1, :, :4], tensors[f"{prefix}.lora_A.weight"].T)
    np.testing.assert_allclose(b[1, :4], 2.0 * tensors[f"{prefix}.lora_B.weight"].T)
    assert not a[:, :, 4:].any() and not b[:, 4:].any()


def test_repeated_kv_heads_repeat_b_columns_head_by_head(tmp_path, arch):
    """Tensor parallelism over more devices than KV heads (worker/kv_heads.py) repeats each head."""
    import dataclasses
    spec = check(write_adapter(tmp_path / "a", r=4, targets=("k_proj",)), arch)
    plain = read_adapter(spec, MAX_LORA_RANK, lora_module_dims(arch), arch.num_layers)
    run_arch = dataclasses.replace(arch, num_kv_heads=2 * arch.num_kv_heads)
    repeated = read_adapter(spec, MAX_LORA_RANK, lora_module_dims(run_arch), arch.num_layers, 2, arch.head_dim)
    b, b2 = plain.modules["k_proj"][1], repeated.modules["k_proj"][1]
    heads = b.reshape(2, MAX_LORA_RANK, 2, 16)  # [layers, r, kv heads, head_dim]
    np.testing.assert_array_equal(b2.reshape(2, MAX_LORA_RANK, 4, 16), np.repeat(heads, 2, axis=2))


def test_the_benchmarks_random_adapters_pass_the_checks(tmp_path, arch):
    """jaxllm.benchmarks.lora_adapters (the GPU runner's LoRA serving bench): every module of every layer."""
    from jaxllm.benchmarks.lora_adapters import main
    assert main([str(tmp_path), "--model", tiny_model("llama"), "--num", "2", "--rank", "8"]) == 0
    for name in ("lora0", "lora1"):
        spec = check(tmp_path / name, arch)
        assert spec.rank == 8 and spec.scaling == 2.0 and len(spec.tensors) == arch.num_layers * 7 * 2
