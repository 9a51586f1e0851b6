"""Writes a byte-level tokenizer (tokenizer.json, tokenizer_config.json) into FOLDER, for a
bundled config's model with random weights: ids 0-255 are the bytes (GPT-2's byte-level
alphabet), 256 is EOS. With `--tokenizer FOLDER` such a model runs text prompts and
structured outputs (scripts/gpu_smoke.sh). Usage: python3 scripts/byte_tokenizer.py FOLDER"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def write_byte_tokenizer(folder: str) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["</s>"])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}, f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 scripts/byte_tokenizer.py FOLDER")
    write_byte_tokenizer(sys.argv[1])
