"""An HF folder's safetensors tensors, each read only in the slices asked for. Apart from the
model loader (models/loader.py): the front end reads an EAGLE head's tensor names with it, and
loads no model code."""
import json
import os
from collections.abc import Iterator

import numpy as np
from safetensors import safe_open


def iter_hf_weights(path: str) -> Iterator[tuple[str, "SafetensorsTensor"]]:
    """(name, tensor source) for every tensor of the HF folder's safetensors files, listed
    by model.safetensors.index.json when present; a source reads only the slices asked
    for. (config.json is jaxllm.config's to read.)"""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]  # beside it may sit e.g. Mistral's consolidated.safetensors
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {path!r}")

    def tensors():
        for file in files:
            with safe_open(os.path.join(path, file), framework="np") as f:
                for name in f.keys():
                    yield name, SafetensorsTensor(f.get_slice(name))

    return tensors()


class SafetensorsTensor:
    """A safetensors tensor read slice by slice from the file's mapping (the slice keeps
    the file open after its safe_open closes)."""

    def __init__(self, tensor_slice):
        self._slice = tensor_slice
        self.shape = tuple(tensor_slice.get_shape())

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return self._slice[index]
