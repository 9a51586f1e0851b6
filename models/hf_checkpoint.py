"""An HF folder's safetensors tensors, each read only in the slices asked for. Apart from the
model loader (models/loader.py): the front end reads an EAGLE head's tensor names with it, and
loads no model code."""
import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

# Tensor types safetensors' numpy reader does not know, read from the file's bytes instead.
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


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
                header = None
                for name in f.keys():
                    tensor_slice = f.get_slice(name)
                    if tensor_slice.get_dtype() not in _RAW_DTYPES:
                        yield name, SafetensorsTensor(tensor_slice)
                        continue
                    header = header or _read_header(os.path.join(path, file))
                    yield name, RawSafetensorsTensor(os.path.join(path, file), header, name)

    return tensors()


class SafetensorsTensor:
    """A safetensors tensor read slice by slice from the file's mapping (the slice keeps
    the file open after its safe_open closes)."""

    def __init__(self, tensor_slice):
        self._slice = tensor_slice
        self.shape = tuple(tensor_slice.get_shape())
        self.dtype = tensor_slice.get_dtype()  # safetensors' name: "BF16", "F8_E4M3", ...

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return self._slice[index]


def _read_header(file: str) -> dict:
    """A safetensors file's header (name -> dtype, shape, data_offsets), with "__data_start__"."""
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return {**header, "__data_start__": 8 + size}


class RawSafetensorsTensor:
    """An FP8 tensor of a safetensors file, read slice by slice from a memory map of its bytes."""

    def __init__(self, file: str, header: dict, name: str):
        entry = header[name]
        self.shape, self.dtype = tuple(entry["shape"]), entry["dtype"]
        self._file, self._dtype = file, _RAW_DTYPES[entry["dtype"]]
        self._offset = header["__data_start__"] + entry["data_offsets"][0]

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        array = np.memmap(self._file, dtype=self._dtype, mode="r", offset=self._offset, shape=self.shape)
        return np.array(array[index])
