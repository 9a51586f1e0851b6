"""A byte-level BPE tokenizer rebuilt from GGUF metadata with the `tokenizers` library.

Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE: GPT-2, Llama 3, SmolLM,
Qwen2, ...). The pieces reproduce transformers' GGUF conversion (integrations/ggml.py),
which the golden fixtures compare against, id for id:
- llama architecture: BPE with fuse_unk and byte_fallback, no normalizer, GPT-2
  byte-level splitting;
- qwen2 / qwen3: NFC, then Qwen2's split regex, then byte-level without regex;
- tokens of type CONTROL (3) are special tokens; BOS is prepended only when the file
  sets `tokenizer.ggml.add_bos_token`.
Like transformers, we ignore `tokenizer.ggml.pre` (llama.cpp's pre-tokenizer name). For
SmolLM2 ("smollm": llama.cpp and the original tokenizer.json split every digit) this
changes ids only for non-ASCII digits such as "²³", whose bytes have merges; ASCII digits
have none, so they come out one per token either way.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_ARCHITECTURES = ("qwen2", "qwen3")
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def build_gguf_tokenizer(meta: dict[str, Any]):
    """PreTrainedTokenizerFast from GGUF metadata (`read_gguf_metadata`'s dict)."""
    from transformers import PreTrainedTokenizerFast

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; only 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    unk = token("unknown")
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("general.architecture") in _QWEN_ARCHITECTURES:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False))
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer = Tokenizer(
            BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
        )
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_CONTROL]
    )
    # llama.cpp matches user-defined tokens verbatim in text; transformers drops them.
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_USER_DEFINED]
    )

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    special = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": token("padding")}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        add_bos_token=add_bos,
        **{k: v for k, v in special.items() if v is not None},
    )
