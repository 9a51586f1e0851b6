"""A tokenizer rebuilt from GGUF metadata with the `tokenizers` library.

Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE: GPT-2, Llama 3, SmolLM,
Qwen2, ...) and Gemma's `"llama"` (SentencePiece BPE, below). The pieces reproduce
transformers' GGUF conversion (integrations/gguf), which the golden fixtures compare
against, id for id:
- llama architecture: BPE with fuse_unk and byte_fallback, no normalizer, GPT-2
  byte-level splitting;
- qwen2 / qwen3: NFC, then Qwen2's split regex, then byte-level without regex;
- tokens of type CONTROL (3) are special tokens; BOS is prepended only when the file
  sets `tokenizer.ggml.add_bos_token`.
Like transformers, we ignore `tokenizer.ggml.pre` (llama.cpp's pre-tokenizer name). For
SmolLM2 ("smollm": llama.cpp and the original tokenizer.json split every digit) this
changes ids only for non-ASCII digits such as "²³", whose bytes have merges; ASCII digits
have none, so they come out one per token either way.

Gemma (gemma2 / gemma3 architecture, tokenizer model "llama"): SentencePiece BPE over
"▁"-for-space text, with byte fallback and no prefix space. The file stores no
merges: they are rebuilt from the vocabulary, ranked by the merged token's place in it
(Gemma's ids follow its merge order), and runs of spaces, stored as real spaces, are
respelled with "▁". A file without a chat template (the base models) gets Gemma's turn format.
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
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"

# Gemma's turn format: <start_of_turn>{user|model}\n{text}<end_of_turn>\n, a system
# message folded into the first user turn, content a string or a list of text parts.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] | trim -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') | trim -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = text + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ ns.system + text }}{%- set ns.system = '' -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def build_gguf_tokenizer(meta: dict[str, Any]):
    """PreTrainedTokenizerFast from GGUF metadata (`read_gguf_metadata`'s dict)."""
    from transformers import PreTrainedTokenizerFast

    model = meta.get("tokenizer.ggml.model")
    gemma = model == "llama" and meta.get("general.architecture") in _GEMMA_ARCHITECTURES
    if model != "gpt2" and not gemma:
        raise ValueError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; only 'gpt2' (byte-level BPE) "
            "and Gemma's 'llama' (SentencePiece)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    unk = token("unknown")
    if gemma:
        tokens = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        tokenizer = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges_by_rank(tokens),
                                  unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        tokenizer = _byte_level_tokenizer(meta, tokens, unk)
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
    elif not gemma:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    special = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": token("padding")}
    chat_template = meta.get("tokenizer.chat_template") or (GEMMA_CHAT_TEMPLATE if gemma else None)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        add_bos_token=add_bos,
        **{k: v for k, v in special.items() if v is not None},
    )


def _byte_level_tokenizer(meta: dict[str, Any], tokens: list[str], unk: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
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
    return tokenizer


def _merges_by_rank(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary whose order is its merge order: every split of a
    token into two tokens, ranked by the merged token's id, then longest left half first
    (transformers' order, which the goldens check).

    "▁the" -> ("▁th", "e"), ("▁t", "he"), ("▁", "the"), those whose halves are tokens.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                ranked.append((i, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
