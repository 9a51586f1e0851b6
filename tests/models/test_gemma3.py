"""Gemma 3 and Gemma 2 on CPU: logit parity of tiny random models with HF transformers,
and the embedded Gemma-3-270M GGUF (config, weights, tokenizer, greedy generation)
against transformers' goldens (scripts/make_fixtures.py)."""
import json
import os

import numpy as np
import pytest

from jaxllm.models.config import ModelArchConfig
from tests.models.test_llama import golden_prompts, load_fixture, make_step, run_prompt

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
GOLDEN_PATH = os.path.join(FIXTURES, "gemma3_golden.json")
GOLDEN = json.load(open(GOLDEN_PATH)) if os.path.exists(GOLDEN_PATH) else {"generations": [], "tokenization": []}
MAX_MODEL_LEN = 512


# -- tiny random models -------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_logits_match_hf_transformers(name):
    config, model, golden = load_fixture(name)
    assert config.sliding_window == 8  # below the 33- and 100-token prompts
    step = make_step(model)
    for token_ids, hf_logits in golden_prompts(golden):
        n = len(token_ids)
        for chunks in [[n]] + ([[16, 16, n - 32]] if n > 32 else []):
            logits = run_prompt(step, config, token_ids, chunks)
            err = np.abs(logits - hf_logits).max()
            tol = 1e-4 * max(1.0, np.abs(hf_logits).max())
            assert err < tol, f"{name}: prompt of {n} tokens in chunks {chunks}: max error {err:.2e} > {tol:.2e}"
