"""Make the compressed-tensors FP8 fixtures in tests/fixtures/tiny/ with HF transformers (the reference).

transformers runs compressed-tensors' FP8 checkpoints on a CPU as the format defines them: the
weights decompressed (e4m3 times their scales) and every Linear's input fake-quantized to e4m3,
dynamically per token or block, or with its static input_scale. (It does not for the other
formats: FineGrainedFP8 dequantizes the whole model on a CPU, and AWQ and GPTQ need CUDA
packages; tests/models/test_quantized_checkpoints.py compares those with dequantized twins.)
Run it in its own venv, as scripts/make_fixtures.py:

    python3.11 -m venv /tmp/fixenv
    /tmp/fixenv/bin/pip install torch==2.13.0 transformers==5.17.0 compressed-tensors==0.20.1 \
        accelerate safetensors numpy ml_dtypes
    /tmp/fixenv/bin/python scripts/make_quant_fixtures.py

Writes tests/fixtures/tiny/<name>/{config.json, model.safetensors, golden.npz} for each name of
CT_FIXTURES: the tiny Llama of tests/models/quant_fixtures.py in that layout, and golden.npz's
prompt [40] int32 and logits [40, vocab] float32, transformers' for the prompt.
"""
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.models import quant_fixtures as qf  # noqa: E402  (the checkpoints' writer, numpy only)


def main() -> None:
    prompt = np.asarray(qf.PROMPT, np.int32)
    for name, (quantization_config, quantize, dense) in qf.CT_FIXTURES.items():
        target = os.path.join(ROOT, "tests", "fixtures", "tiny", name)
        with tempfile.TemporaryDirectory() as tmp:
            path, _ = qf.write_pair(tmp, name, quantization_config, quantize, dense=dense)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(path, target)
        model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor(prompt[None], dtype=torch.long)).logits[0].numpy()
        np.savez(os.path.join(target, "golden.npz"), prompt=prompt, logits=logits.astype(np.float32))
        print(name, "->", target)


if __name__ == "__main__":
    main()
