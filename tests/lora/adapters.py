"""The LoRA tests' adapters: the PEFT fixtures of scripts/make_lora_fixtures.py (goldens from HF PEFT),
and adapters written here, good or broken in one chosen way."""
import json
import os

import numpy as np

from tests.conftest import tiny_model

GOLDEN_ADAPTERS = ("attn_r8", "mlp_r4_rslora", "all_r16")  # ids 1, 2, 3 (lora_request)
MAX_LORA_RANK = 16
# fp32 on CPU against PEFT's fp32 torch forward: the logprobs agree to rounding (seen: 2e-6).
LOGPROB_ATOL = 1e-4
# The tiny Llama's module shapes [out, in] (hidden 64, 4 q heads and 2 KV heads of 16, intermediate 128).
MODULE_SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
                 "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}


def golden() -> dict[str, np.ndarray]:
    with np.load(os.path.join(tiny_model("lora"), "golden.npz")) as g:
        return dict(g)


def golden_prompts() -> list[dict]:
    g = golden()
    return [{"prompt_token_ids": g[f"prompt_{i}"].tolist()} for i in range(sum(k.startswith("prompt_") for k in g))]


def greedy():
    from jaxllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def assert_golden(outputs, model: str, prompt_indices) -> None:
    """Each output (RequestOutputs of greedy()) has PEFT's tokens and logprobs for its golden prompt."""
    g = golden()
    for out, i in zip(outputs, prompt_indices, strict=True):
        c = out.outputs[0]
        assert list(c.token_ids) == g[f"{model}_tokens"][i].tolist(), (model, i)
        logprobs = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
        np.testing.assert_allclose(logprobs, g[f"{model}_logprobs"][i], atol=LOGPROB_ATOL, rtol=0)


def lora_request(name: str):
    from jaxllm import LoRARequest
    return LoRARequest(name, GOLDEN_ADAPTERS.index(name) + 1, tiny_model(f"lora/{name}"))


def write_adapter(folder, r: int = 4, targets=("q_proj", "v_proj"), shapes: dict | None = None, seed: int = 0,
                  **config) -> str:
    """A PEFT adapter folder for the tiny Llama: rank r on `targets` of both layers, random weights;
    `shapes` overrides a tensor's shape by its name's end (e.g. {"0.self_attn.q_proj.lora_A": (4, 8)})."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        for module in targets:
            out_dim, in_dim = MODULE_SHAPES.get(module, (64, 64))
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            for side, shape in (("lora_A", (r, in_dim)), ("lora_B", (out_dim, r))):
                shape = (shapes or {}).get(f"{layer}.{kind}.{module}.{side}", shape)
                tensors[f"{prefix}.{side}.weight"] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), **config}, f)
    return str(folder)
