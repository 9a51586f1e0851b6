"""The server's tokenization (jaxllm/entrypoints/openai/prompts.py): the same ids as the
tokenizer's own encode, and a prompt too long for max_model_len refused, by its characters
only where that is sound."""
import pytest
from transformers import AutoTokenizer

from jaxllm.entrypoints.openai.prompts import PromptEncoder, PromptTooLong, max_chars_per_token
from tests.conftest import tiny_llama_with_tokenizer, write_char_tokenizer
from tests.entrypoints.conftest import write_byte_tokenizer

TEXTS = ["hello world", " leading space", "<s>special</s> in the middle", "naïve café 日本語 🙂", "\n\n\t x",
         "a" * 1000, "\x04\x06 control bytes"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from models.gguf import find_default_model, load_gguf_tokenizer
    found = {"char": AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer(tmp_path_factory.mktemp("c"),
                                                                             write_char_tokenizer)),
             "byte": AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer(tmp_path_factory.mktemp("b"),
                                                                             write_byte_tokenizer))}
    try:
        found["smollm2"] = load_gguf_tokenizer(find_default_model())
    except FileNotFoundError:
        pass
    return found


@pytest.mark.parametrize("name", ["char", "byte", "smollm2"])
def test_the_encoder_gives_the_tokenizers_own_ids(tokenizers, name):
    if name not in tokenizers:
        pytest.skip("the embedded SmolLM2 is not installed")
    tokenizer = tokenizers[name]
    encoder = PromptEncoder(tokenizer, 100_000)
    for text in TEXTS:
        for special in (True, False):
            assert encoder.encode(text, special) == tokenizer.encode(text, add_special_tokens=special), text


def test_chars_per_token_is_bounded_only_where_no_token_can_stand_for_more(tokenizers):
    # The byte-level BPE: every token a byte or a special token of 3-5 characters.
    assert max_chars_per_token(tokenizers["byte"]) == 5
    # WordLevel maps an unknown word, however long, to one <unk>: no bound.
    assert max_chars_per_token(tokenizers["char"]) is None
    if "smollm2" in tokenizers:
        # Its vocabulary lacks some bytes (0x04 among them) and fuses unknown runs: 1000
        # characters of them are one token, so a bound by characters would be wrong.
        assert tokenizers["smollm2"].encode("\x04" * 1000, add_special_tokens=False) == [0]
        assert max_chars_per_token(tokenizers["smollm2"]) is None


def test_a_text_too_long_is_refused_by_its_characters_or_its_token_count(tokenizers):
    byte, char = tokenizers["byte"], tokenizers["char"]
    with pytest.raises(PromptTooLong) as by_chars:
        PromptEncoder(byte, 10).encode("x" * 51)  # 51 characters > 10 tokens * 5 characters
    assert by_chars.value.num_tokens is None  # refused before tokenizing
    assert PromptEncoder(byte, 10).encode("x" * 10) == byte.encode("x" * 10)
    num_tokens = len(char.encode("x" * 51))
    with pytest.raises(PromptTooLong) as by_tokens:
        PromptEncoder(char, num_tokens - 1).encode("x" * 51)
    assert by_tokens.value.num_tokens == num_tokens
    assert PromptEncoder(char, num_tokens - 1).encode("x" * 51, max_tokens=num_tokens) == char.encode("x" * 51)
