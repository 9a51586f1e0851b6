"""Text prompts to token ids for the server, off the event loop and bounded by max_model_len.

A 10 MB prompt takes the tokenizer ~10 s; on the event loop that stalled every stream and
/health. Here the work runs in worker threads (the tokenizers library's encode_batch_fast
lets go of the interpreter while it works; its encode does not), and a prompt that cannot
fit is refused cheaply: by its length in characters when the tokenizer bounds the
characters a token stands for (`max_chars_per_token`), else by its Encoding's length
before the ids become a Python list (10M ids take the interpreter for most of a second).
"""
import json

from tokenizers import pre_tokenizers

# Pieces of a tokenizers pipeline that never drop or merge characters: after them every
# character of the text is still there, in order, for some token to cover.
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Prepend"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text that one token can stand for, or None where no bound is
    sure. With one, a text of more than max_model_len * bound characters cannot fit.

    Sure means: a BPE model (each token a vocabulary entry, covering that entry's characters;
    a ByteLevel entry's length is its byte count, at least its character count), no
    normalizer or pre-tokenizer step that removes characters or merges them (NFC does,
    Strip does, a Split that removes its matches does), no unknown run fused into one
    token, and no truncation (the backend's would cut the prompt instead of refusing it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None:
        return None
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model["type"] != "BPE" or not _keeps_characters(spec["normalizer"], _KEEPING_NORMALIZERS):
        return None
    if not _keeps_characters(spec["pre_tokenizer"], _KEEPING_PRE_TOKENIZERS):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if model.get("fuse_unk") and model.get("unk_token") is not None and not _never_unknown(spec, vocab):
        return None
    return max(map(len, vocab))


def _keeps_characters(step: dict | None, keeping: set[str]) -> bool:
    if step is None:
        return True
    if step["type"] == "Sequence":
        return all(_keeps_characters(s, keeping) for s in step.get("normalizers", step.get("pretokenizers", [])))
    if step["type"] == "Replace":  # one string for another no shorter (Llama's " " -> "▁")
        pattern = step["pattern"].get("String")
        return pattern is not None and len(step["content"]) >= len(pattern)
    return step["type"] in keeping and str(step.get("behavior", "")).lower() != "removed"


def _never_unknown(spec: dict, vocab: dict[str, int]) -> bool:
    """Every byte has a token of its own (byte-level pieces, or SentencePiece's byte fallback)."""
    if spec["model"].get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return _is_byte_level(spec["pre_tokenizer"]) and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())


def _is_byte_level(step: dict | None) -> bool:
    if step is None:
        return False
    return step["type"] == "ByteLevel" or any(_is_byte_level(s) for s in step.get("pretokenizers") or ())


class PromptTooLong(ValueError):
    def __init__(self, num_tokens: int | None):
        super().__init__(num_tokens)
        self.num_tokens = num_tokens  # None: refused by its length in characters


class PromptEncoder:
    """The tokenizer as the server uses it (what chat_utils.apply_chat_template needs of one):
    an encode that refuses a text of more than `max_tokens` tokens as cheaply as it can
    (PromptTooLong). Thread-safe: encoding only reads the tokenizer, and the one step that
    writes it (transformers turning off a tokenizer.json's truncation or padding, on the
    first encode) is done here, once, before any thread shares it."""

    def __init__(self, tokenizer, max_tokens: int):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        tokenizer.encode("warm-up")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The backend's encode_batch_fast gives transformers' ids (tests/entrypoints/test_prompts.py)
        # without offsets, and lets the length be read before the ids become a list; not with
        # padding or truncation set.
        self._backend = backend if backend is not None and backend.truncation is None \
            and backend.padding is None else None
        self.chars_per_token = max_chars_per_token(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        if self.chars_per_token is not None and len(text) > max_tokens * self.chars_per_token:
            raise PromptTooLong(None)
        if self._backend is None:
            encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            encoding = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if len(encoding) > max_tokens:
            raise PromptTooLong(len(encoding))
        return encoding if self._backend is None else encoding.ids

    def apply_chat_template(self, messages, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, **kwargs)
