"""msgpack encoding of the engine's messages (msgspec). numpy arrays travel as
their raw bytes with dtype and shape, never as lists."""
from typing import Any

import msgspec
import numpy as np


def _enc_hook(obj):
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).data)
    raise TypeError(f"cannot encode a {type(obj).__name__}")


def _dec_hook(kind, obj):
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    raise TypeError(f"cannot decode a {kind}")


class MsgpackEncoder:
    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    def __init__(self, kind=Any):
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)

    def decode(self, data):
        return self._decoder.decode(data)
