"""Random LoRA adapters in PEFT's layout for a model's shape, for the GPU runner's LoRA serving bench:

    python -m jaxllm.benchmarks.lora_adapters DIR --model llama-3.1-8b --num 8 --rank 16

writes DIR/lora0 ... DIR/lora{num-1}, each rank `rank` on every layer's q, k, v, o, gate, up and down
projections (float16, small normal weights), and prints the `--lora-modules` of `jaxllm serve` that
serves them. A rank-16 adapter of the 8B shape holds 42M params (84 MB).
"""
import argparse
import json
import os

import numpy as np

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def write_adapters(folder: str, model: str, num: int, rank: int, seed: int = 0) -> list[str]:
    """The adapters' folders, written (the module's docstring); model: a bundled config's name or an
    HF folder."""
    from safetensors.numpy import save_file

    from jaxllm.model_source import resolve_model
    from jaxllm.models.lora import LORA_MODULES, lora_module_dims

    arch = resolve_model(model, "dummy")[3]
    dims = lora_module_dims(arch)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(num):
        tensors = {}
        for layer in range(arch.num_layers):
            for module, d in dims.items():
                prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}"
                for side, shape in (("lora_A", (rank, d.in_dim)), ("lora_B", (d.out_dim, rank))):
                    weight = 0.01 * rng.standard_normal(shape, np.float32)
                    tensors[f"{prefix}.{module}.{side}.weight"] = weight.astype(np.float16)
        path = os.path.join(folder, f"lora{i}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_MODULES)}, f)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--model", required=True, help="a bundled config's name or an HF folder")
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    ns = parser.parse_args(argv)
    paths = write_adapters(ns.folder, ns.model, ns.num, ns.rank)
    print(" ".join(f"{os.path.basename(p)}={p}" for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
