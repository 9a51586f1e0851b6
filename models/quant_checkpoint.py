"""A quantized checkpoint's tensors as the loader takes them: each quantized Linear's tensors
(AWQ's qweight, qzeros, scales; an FP8 weight and its scales...) gathered, checked against the
QuantConfig, and handed on under the names of the params they fill (models/fp8.py,
models/int4.py), each in the HF-facing layout the loader packs and transposes: out rows first.

    format              checkpoint tensors (per Linear)              -> the loader's tensors
    fp8, per tensor     weight e4m3 [N, K], weight_scale [1] or []    -> weight, weight_scale [N]
      or channel        (compressed-tensors: [N, 1]), input_scale    -> input_scale [] (static only)
    fp8, blocks         weight, weight_scale_inv (compressed-tensors:
                        weight_scale) [N / bn, K / bk]               -> weight, weight_scale
    awq                 qweight [K, N / 8] int32, qzeros [K / G, N / 8] int32, scales [K / G, N]
    gptq                qweight [K / 8, N] int32, qzeros [K / G, N / 8] int32, scales [K / G, N], g_idx [K]
                                        -> weight_packed [N, K / 2] uint8, weight_scale [N, K / G],
                                           weight_zero [N, K / G] uint8, input_perm [K] (GPTQ act-order)

Packing orders: AWQ puts 8 columns in an int32, column AWQ_ORDER[i] in bits 4i..4i+3; GPTQ puts
8 rows of qweight (8 columns of qzeros) in order, element j in bits 4j..4j+3, and stores its
zero points minus 1 (checkpoint_format "gptq"; "gptq_v2" stores them as they are). GPTQ's
g_idx names each input row's group; with act-order (desc_act) the rows are sorted by it here,
so that groups are contiguous, and the activations are permuted the same way when they come.

The conversion of a tensor reads it whole on first use (TensorSource: a param's pieces come
from it); a quantized Linear's tensors are 4 to 8x smaller than its bf16 weight.
"""
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxllm.models.int4 import pack_groups
from jaxllm.models.quant_config import FP8_BLOCK, FP8_CHANNEL, INT4, MODEL_DTYPE_LINEARS, QuantConfig
from jaxllm.utils import cdiv

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8


def quantized_weights(weights: Iterable[tuple[str, object]], quant: QuantConfig) -> Iterator[tuple[str, object]]:
    """(name, tensor source) pairs with each quantized Linear's tensors converted (see the module's
    table); other tensors pass as they are. Raises ValueError naming the tensor for a wrong shape,
    dtype or group, and, at the end, for a quantized Linear whose tensors did not all come."""
    leaves = _checkpoint_leaves(quant)
    pending: dict[str, dict[str, object]] = {}  # Linear -> {leaf: its source} so far
    for name, source in weights:
        module, _, leaf = name.rpartition(".")
        attr = module.rpartition(".")[2]
        linear = attr.endswith(("_proj", "_proj_with_mqa")) or _is_expert(module)
        if leaf not in leaves or not linear or not quant.quantizes(module):
            yield name, source
            continue
        parts = pending.setdefault(module, {})
        parts[leaves[leaf]] = source
        if len(parts) == len(leaves):
            del pending[module]
            dequantized = _is_expert(module) or attr in MODEL_DTYPE_LINEARS or (
                quant.scheme == FP8_BLOCK and not quant.whole_blocks(*parts["weight"].shape))
            yield from (_dequantized if dequantized else _convert)(module, parts, quant)
    missing = [f"{module}.{name}" for module, parts in pending.items() for name, leaf in leaves.items()
               if leaf not in parts]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) of its quantized Linears: "
                         f"{', '.join(missing[:8])}" + (", ..." if len(missing) > 8 else ""))


def _checkpoint_leaves(quant: QuantConfig) -> dict[str, str]:
    """The tensors of one quantized Linear: their names in the checkpoint -> the leaf the converters take."""
    if quant.method == "awq":
        return {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales"}
    if quant.method == "gptq":
        return {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales", "g_idx": "g_idx"}
    # DeepSeek's block scales are named weight_scale_inv, though they multiply as every other scale
    scale = "weight_scale_inv" if quant.method == "fp8" and quant.scheme == FP8_BLOCK else "weight_scale"
    leaves = {"weight": "weight", scale: "weight_scale"}
    return {**leaves, "input_scale": "input_scale"} if quant.static_input_scale else leaves


def _is_expert(module: str) -> bool:
    """Whether the HF module is one expert of a MoE layer's (model.layers.0.mlp.experts.3.gate_proj,
    Mixtral's block_sparse_moe.experts.3.w1)."""
    return ".experts." in module


def _dequantized(module: str, parts: dict, quant: QuantConfig) -> list[tuple[str, object]]:
    """An FP8 weight [N, K] the engine does not run quantized, checked as a Linear's, dequantized to
    float32 by its scales (per tensor, channel or block, the last blocks maybe partial): one expert
    (the engine stacks the experts and holds them in e4m3 with a scale per expert and output channel,
    as quantization="fp8" does: models/moe.py), a Linear held in the model's dtype
    (MODEL_DTYPE_LINEARS), or a block weight of partial blocks. A static input scale is not used."""
    _check(quant.scheme != INT4, f"tensor {module}: a {quant.method} checkpoint's {module.rpartition('.')[2]} "
           "does not load yet (the engine holds it unquantized)")
    tensors = dict(_fp8(module, parts, quant))
    weight, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
    rows, cols = weight.shape

    def dequantize(w: np.ndarray, s: np.ndarray) -> np.ndarray:
        if s.ndim == 2:  # blocks [N / bn, K / bk], rounded up
            s = np.repeat(np.repeat(s.astype(np.float32), quant.block[0], 0), quant.block[1], 1)[:rows, :cols]
        else:  # per output channel [N]
            s = s.astype(np.float32)[:, None]
        return w.astype(np.float32) * s

    return [(f"{module}.weight", Converted((rows, cols), dequantize, weight, scale))]


def _convert(module: str, parts: dict, quant: QuantConfig) -> list[tuple[str, object]]:
    if quant.method == "awq":
        return _awq(module, parts, quant.group_size)
    if quant.method == "gptq":
        return _gptq(module, parts, quant)
    return _fp8(module, parts, quant)


class Converted:
    """A tensor source made from other sources by `convert(*arrays)`, read whole on first use."""

    def __init__(self, shape: tuple[int, ...], convert: Callable, *sources):
        self.shape, self._convert, self._sources, self._array = shape, convert, sources, None

    def __getitem__(self, index):
        if self._array is None:
            self._array = self._convert(*(_read(source) for source in self._sources))
            self._sources = ()
        return self._array[index]


def _read(source) -> np.ndarray:
    return np.asarray(source[tuple(slice(None) for _ in source.shape)])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# ---- FP8 ----

def _fp8(module: str, parts: dict, quant: QuantConfig) -> list[tuple[str, object]]:
    weight = parts["weight"]
    dtype = str(getattr(weight, "dtype", ""))
    _check(dtype in ("F8_E4M3", "float8_e4m3fn"), f"tensor {module}.weight has dtype {dtype or 'unknown'}, "
           f"expected F8_E4M3 ({quant.method} quantizes {module})")
    scale = parts["weight_scale"]
    scale_name = module + "." + next(name for name, leaf in _checkpoint_leaves(quant).items() if leaf == "weight_scale")
    rows, cols = weight.shape
    if quant.scheme == FP8_BLOCK:
        bn, bk = quant.block
        want = (cdiv(rows, bn), cdiv(cols, bk))  # a partial last block has a scale (then loads dequantized)
        _check(tuple(scale.shape) == want, f"tensor {scale_name} has shape {tuple(scale.shape)}, expected {want} "
               f"(blocks of {quant.block} over the weight's {weight.shape})")
        return [(f"{module}.weight", weight), (f"{module}.weight_scale", scale)]
    # A per-tensor scale holds for every output channel: exactly one scale per channel.
    size = int(np.prod(scale.shape))
    _check(size in (1, rows) and (size == 1 or tuple(scale.shape) in ((rows,), (rows, 1))),
           f"tensor {scale_name} has shape {tuple(scale.shape)}, expected [1] (per tensor) or [{rows}, 1] (per channel)")
    converted = [(f"{module}.weight", weight),
                 (f"{module}.weight_scale", Converted((rows,), lambda s: np.broadcast_to(
                     s.astype(np.float32).reshape(-1), (rows,)), scale))]
    if quant.scheme == FP8_CHANNEL and quant.static_input_scale:
        input_scale = parts["input_scale"]
        _check(int(np.prod(input_scale.shape)) == 1, f"tensor {module}.input_scale has shape "
               f"{tuple(input_scale.shape)}, expected [1] (one static scale per tensor)")
        converted.append((f"{module}.input_scale", Converted((), lambda s: s.astype(np.float32).reshape(()),
                                                             input_scale)))
    return converted


# ---- AWQ and GPTQ ----

def _unpack_int32(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 [..] -> the 8 nibbles of each, in bit order, along `axis` (8x as long), as uint8."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    nibbles = (packed.astype(np.uint32)[..., None] >> shifts) & 0xF  # [..., 8]
    nibbles = np.moveaxis(nibbles, -1, axis + 1)  # each element's 8 right after it along `axis`
    shape = list(packed.shape)
    shape[axis] *= 8
    return nibbles.reshape(shape).astype(np.uint8)


def _int4_shapes(module: str, parts: dict, k: int, n: int, group_size: int) -> None:
    _check(k % group_size == 0, f"tensor {module}.qweight has {k} input rows, not a multiple of "
           f"quantization_config.group_size ({group_size})")
    for leaf, want in (("scales", (k // group_size, n)), ("qzeros", (k // group_size, n // 8))):
        got = tuple(parts[leaf].shape)
        _check(got == want, f"tensor {module}.{leaf} has shape {got}, expected {want} for {k} input rows in "
               f"groups of quantization_config.group_size ({group_size})")


def _int4_tensors(module: str, k: int, n: int, group_size: int, packed: Converted, parts: dict,
                  zeros: Callable) -> list[tuple[str, object]]:
    """The loader's weight_packed, weight_scale and weight_zero, out rows first."""
    return [(f"{module}.weight_packed", packed),
            (f"{module}.weight_scale", Converted((n, k // group_size), np.transpose, parts["scales"])),
            (f"{module}.weight_zero", Converted((n, k // group_size), lambda z: zeros(z).T, parts["qzeros"]))]


def _awq(module: str, parts: dict, group_size: int) -> list[tuple[str, object]]:
    k, n = parts["qweight"].shape[0], parts["qweight"].shape[1] * 8
    _int4_shapes(module, parts, k, n, group_size)
    columns = np.argsort(AWQ_ORDER)  # column c of the 8 is nibble [0, 4, 1, 5, 2, 6, 3, 7][c]

    def unpack(packed):  # [rows, N / 8] -> [rows, N], columns in order
        nibbles = _unpack_int32(packed, 1).reshape(packed.shape[0], -1, 8)
        return nibbles[:, :, columns].reshape(packed.shape[0], -1)

    packed = Converted((n, k // 2), lambda q: pack_groups(unpack(q), group_size).T, parts["qweight"])
    return _int4_tensors(module, k, n, group_size, packed, parts, unpack)


def _gptq(module: str, parts: dict, quant: QuantConfig) -> list[tuple[str, object]]:
    g = quant.group_size
    k, n = parts["qweight"].shape[0] * 8, parts["qweight"].shape[1]
    _int4_shapes(module, parts, k, n, g)
    _check(tuple(parts["g_idx"].shape) == (k,), f"tensor {module}.g_idx has shape {tuple(parts['g_idx'].shape)}, "
           f"expected ({k},)")

    def row_order(g_idx: np.ndarray) -> np.ndarray:
        """The rows sorted by group; each group must hold G of them."""
        order = np.argsort(g_idx, kind="stable")
        _check(np.array_equal(g_idx[order], np.arange(k) // g), f"tensor {module}.g_idx does not give each "
               f"group quantization_config.group_size ({g}) input rows")
        _check(quant.act_order or np.array_equal(order, np.arange(k)), f"tensor {module}.g_idx orders the "
               "rows by activation (act-order), but quantization_config.desc_act is false")
        return order

    packed = Converted((n, k // 2), lambda q, g_idx: pack_groups(_unpack_int32(q, 0)[row_order(g_idx)], g).T,
                       parts["qweight"], parts["g_idx"])
    converted = _int4_tensors(module, k, n, g, packed, parts,
                              lambda z: _unpack_int32(z, 1) + np.uint8(quant.zero_offset))
    if quant.act_order:
        converted.append((f"{module}.input_perm", Converted((k,), lambda g_idx: row_order(g_idx).astype(np.int32),
                                                            parts["g_idx"])))
    return converted
