"""quantization="fp8" (models/fp8.py): the e4m3 kernels and scales are what the weights
quantize to, the FP8 product is exactly the product of the dequantized operands, and a
quantized model stays within a stated distance of the unquantized one (the tiny Llama;
the embedded SmolLM2 under teacher forcing)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fp8 import E4M3_MAX, Fp8Linear, quantize_kernel, quantize_rows
from jaxllm.models.llama import Linear
from tests.conftest import tiny_model
from tests.engine.test_prefix_caching import plain_forward_logits

pytestmark = pytest.mark.timeout(600)


def dequantize(kernel8, scale):
    """e4m3 [*out, in] and scale [*out] -> float32 [in, *out]."""
    return jnp.moveaxis(kernel8.astype(jnp.float32) * scale[..., None], -1, 0)


@pytest.mark.parametrize("shape", [(64, 48), (64, 2, 24)])
def test_a_kernel_quantizes_per_output_channel_within_e4m3s_precision(shape):
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, int(np.prod(shape[1:]))).reshape(shape[1:])
    kernel8, scale = quantize_kernel(w)
    assert kernel8.dtype == jnp.float8_e4m3fn and kernel8.shape == (*shape[1:], shape[0])
    np.testing.assert_allclose(scale, jnp.max(jnp.abs(w), axis=0) / E4M3_MAX, rtol=1e-6)
    error = np.abs(dequantize(kernel8, scale) - w)
    # 3 mantissa bits: half an ulp is 2^-4 of the value; below e4m3's smallest normal (2^-6
    # of the scale), half the subnormal spacing, 2^-10 of the scale.
    assert np.all(error <= 2.0**-4 * np.abs(w) + 2.0**-10 * scale)


@pytest.mark.parametrize("out", [40, (2, 24)])
def test_the_fp8_product_is_the_product_of_the_dequantized_operands(out):
    linear = Linear(32, out, ("embed", "mlp") if isinstance(out, int) else ("embed", None, "mlp"), bias=True,
                    dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 32)).at[2].set(0.0)  # one all-zero token
    kernel8, scale = quantize_kernel(linear.kernel[...])
    fp8 = Fp8Linear(kernel8, scale, ("mlp", "embed"), linear.bias)
    x8, x_scale = quantize_rows(x)
    expected = (x8.astype(jnp.float32) * x_scale[:, None]) @ dequantize(kernel8, scale).reshape(32, -1)
    y = fp8(x)
    np.testing.assert_allclose(y.reshape(5, -1), expected + linear.bias[...].reshape(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[2], jnp.broadcast_to(linear.bias[...], y.shape[1:]))  # no NaN from a zero row
    # and close to the unquantized product: about 0.04 relative on random operands
    assert np.linalg.norm(y - linear(x)) / np.linalg.norm(linear(x)) < 0.06


def test_a_quantized_tiny_llama_keeps_its_logits_close():
    path = tiny_model("llama")
    with open(os.path.join(path, "config.json")) as f:
        arch = ModelArchConfig.from_hf_config(json.load(f))
    ids = list(np.random.default_rng(0).integers(0, arch.vocab_size, 40))
    exact, fp8 = plain_forward_logits(path, arch, ids), plain_forward_logits(path, arch, ids, "fp8")
    centered = exact - exact.mean(-1, keepdims=True)
    assert np.linalg.norm(fp8 - exact) / np.linalg.norm(centered) < 0.2  # 0.13 measured
    assert (fp8.argmax(-1) == exact.argmax(-1)).mean() >= 0.75  # 0.875 measured, on random weights' flat logits


TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital "
        "of Germany. Water boils at one hundred degrees Celsius at sea level. def add(a, b):\n    return a + b\n")


# A second SmolLM2 engine, as small as one prompt of TEXT needs: its compile and its cache's zeros are
# what the test pays for (the default CPU cache, 512 MiB, costs more than the forward passes).
ONE_PROMPT = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks_override=16,
                  show_progress=False, enable_multiprocessing=False)


def teacher_forced(llm: LLM) -> list[tuple[float, int]]:
    """(logprob of the text's next token, the most likely token) at each position of TEXT."""
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return [(d[t].logprob, max(d, key=lambda k: d[k].logprob))
            for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def test_the_embedded_model_in_fp8_stays_within_the_stated_tolerance(smollm2):
    """SmolLM2-135M, teacher-forced over 48 tokens of text: the mean |logprob| difference is
    under 0.4 nats (0.27 measured) and the top token agrees at >= 80% of positions (87.5%)."""
    exact = teacher_forced(smollm2)
    with LLM(quantization="fp8", **ONE_PROMPT) as llm:
        fp8 = teacher_forced(llm)
    assert len(fp8) == len(exact) > 40
    assert np.mean([abs(a[0] - b[0]) for a, b in zip(exact, fp8)]) < 0.4
    assert np.mean([a[1] == b[1] for a, b in zip(exact, fp8)]) >= 0.8
