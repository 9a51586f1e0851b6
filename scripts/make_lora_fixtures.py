"""Make the LoRA golden fixtures in tests/fixtures/tiny/lora/ with torch + HF PEFT (the reference).

The tests read what this script wrote and need no torch. Run it in its own venv (Python 3.11,
where torch 2.13.0 CPU is on local disk):

    python3.11 -m venv /tmp/lorafix
    /tmp/lorafix/bin/pip install torch==2.13.0 transformers==5.17.0 peft safetensors numpy
    /tmp/lorafix/bin/python scripts/make_lora_fixtures.py

Writes, for the tiny Llama of tests/fixtures/tiny/llama (scripts/make_fixtures.py made it):
  tests/fixtures/tiny/lora/<name>/{adapter_config.json, adapter_model.safetensors}
      three PEFT adapters with random A and B (B nonzero, so each changes the greedy tokens):
      ADAPTERS says each one's rank, alpha, target modules and layers; "all_r16" is stored in bf16
      (its values bf16-exact: the goldens are the same either way).
  tests/fixtures/tiny/lora/golden.npz
      prompt_<i> int32 [L_i] for the prompts of PROMPTS, and per model ("base" and each adapter)
      <model>_tokens int32 [len(PROMPTS), NUM_TOKENS]: PEFT's greedy continuation (EOS ignored),
      <model>_logprobs float32 [len(PROMPTS), NUM_TOKENS]: each greedy token's logprob.
"""
import json
import os
import shutil

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tests", "fixtures", "tiny", "llama")
OUT = os.path.join(ROOT, "tests", "fixtures", "tiny", "lora")
PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [1, 40, 41, 42], list(range(60, 80)), [7]]
NUM_TOKENS = 8
WEIGHT_STD = 0.1  # A and B entries: deltas of the order of the base projections' outputs
ADAPTERS = {
    "attn_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp_r4_rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"],
                          layers_to_transform=[0]),
    "all_r16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]),
}
BF16_ADAPTERS = ("all_r16",)


def base_model():
    return AutoModelForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def greedy(model) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's NUM_TOKENS greedy tokens and their logprobs, by full forwards (no cache, no EOS)."""
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids, taken, lps = list(prompt), [], []
        for _ in range(NUM_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            token = int(logits.argmax())
            taken.append(token)
            lps.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
        tokens.append(taken)
        logprobs.append(lps)
    return np.array(tokens, np.int32), np.array(logprobs, np.float32)


def make_adapter(name: str, fields: dict, seed: int):
    model = get_peft_model(base_model(), LoraConfig(init_lora_weights=False, lora_dropout=0.0, **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:  # bf16-exact values: the bf16 copy computes the same goldens
                param.copy_((torch.randn(param.shape, generator=generator) * WEIGHT_STD).bfloat16().float())
    folder = os.path.join(OUT, name)
    model.save_pretrained(folder)
    os.remove(os.path.join(folder, "README.md"))
    config_file = os.path.join(folder, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = os.path.relpath(BASE, ROOT)  # not this machine's path
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if name in BF16_ADAPTERS:
        weights_file = os.path.join(folder, "adapter_model.safetensors")
        save_file({k: v.bfloat16() for k, v in load_file(weights_file).items()}, weights_file)
    return model.eval()


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    golden = {f"prompt_{i}": np.array(p, np.int32) for i, p in enumerate(PROMPTS)}
    golden["base_tokens"], golden["base_logprobs"] = greedy(base_model())
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        tokens, logprobs = greedy(make_adapter(name, fields, seed))
        assert (tokens != golden["base_tokens"]).any(axis=1).all(), f"{name} leaves a prompt's tokens as the base's"
        golden[f"{name}_tokens"], golden[f"{name}_logprobs"] = tokens, logprobs
        with open(os.path.join(OUT, name, "adapter_config.json")) as f:
            print(name, {k: v for k, v in json.load(f).items() if k in ("r", "lora_alpha", "use_rslora")},
                  tokens[0].tolist())
    np.savez(os.path.join(OUT, "golden.npz"), **golden)
    print("base", golden["base_tokens"][0].tolist())


if __name__ == "__main__":
    main()
