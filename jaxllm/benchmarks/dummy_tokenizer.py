"""Tokenizers for a bundled config's model with random weights (`--load-format dummy`), which
has none of its own; pass the folder as `--tokenizer FOLDER`.

  byte  ids 0-255 are the bytes (GPT-2's byte-level alphabet), 256 is EOS: text prompts and
        structured outputs run (`bench step --sampling all --structured-requests N`).
  word  one word-level token per id of the vocabulary (" w123"): every id a random model
        samples decodes to text, so each streamed chunk has some and `bench serve` times every
        token (a byte tokenizer would leave most ids unknown). Its chat template writes each
        message as "role: content" and a request's tools as their JSON first, a token for each
        whitespace-separated piece (a real tokenizer makes about twice as many of JSON).

    python -m jaxllm.benchmarks.dummy_tokenizer byte /tmp/bytetok
    python -m jaxllm.benchmarks.dummy_tokenizer word /tmp/wordtok --model llama-3.1-8b
"""
import argparse
import json
import os


def write_byte_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["</s>"])
    _save(tokenizer, folder, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})


WORD_CHAT_TEMPLATE = (
    "{% if tools %}tools: {% for tool in tools %}{{ tool | tojson }} {% endfor %}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


def write_word_tokenizer(folder: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    _save(tokenizer, folder, {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": WORD_CHAT_TEMPLATE})


def _save(tokenizer, folder: str, config: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def vocab_size_of(model: str) -> int:
    """The vocabulary of a model folder's config.json or of a bundled config's name."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
    else:
        import importlib.resources
        path = importlib.resources.files("jaxllm.models.configs") / f"{model}.json"
    with open(path) as f:
        return json.load(f)["vocab_size"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxllm.benchmarks.dummy_tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("byte", "word"))
    parser.add_argument("folder")
    parser.add_argument("--model", help="word: the model whose vocabulary to cover (a folder or a bundled config)")
    ns = parser.parse_args(argv)
    if ns.kind == "byte":
        write_byte_tokenizer(ns.folder)
        print(f"tokenizer: 256 bytes and EOS in {ns.folder}")
    else:
        if not ns.model:
            parser.error("word needs --model")
        vocab_size = vocab_size_of(ns.model)
        write_word_tokenizer(ns.folder, vocab_size)
        print(f"tokenizer: {vocab_size} word tokens in {ns.folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
