"""A checkpoint's tensors as the loader reads them (models/loader.py): TensorSource, the protocol of a
tensor that reads only the pieces asked for (a device's shard), and the sources that pack HF's
tensors into the engine's fused params (q, k and v; gate and up; a MoE layer's stacked experts) as
they are read, so a device reads just its rows of each part."""
from typing import Protocol

import numpy as np

Index = tuple[slice, ...]  # one slice per axis: the piece of a tensor one device holds


class TensorSource(Protocol):
    """A checkpoint tensor, in HF layout, that reads only the pieces asked for:
    `source[index]` is the numpy array of that piece. A numpy array is one."""
    shape: tuple[int, ...]

    def __getitem__(self, index: Index) -> np.ndarray: ...


class SharedSource:
    """One tensor that a fused Linear's parts each have: the largest of them ("max"), or the one
    they all hold ("same"; a ValueError naming the tensors if they differ). Small: read whole."""

    def __init__(self, parts: list[tuple[str, TensorSource]], fuse: str):
        self.parts, self.fuse = parts, fuse
        self.shape = tuple(parts[0][1].shape)

    def __getitem__(self, index: Index) -> np.ndarray:
        arrays = [np.asarray(source[tuple(slice(None) for _ in self.shape)]) for _, source in self.parts]
        if self.fuse == "max":
            return np.maximum.reduce(arrays)[index]
        if any(not np.array_equal(a, arrays[0]) for a in arrays[1:]):
            raise ValueError(f"tensors {[name for name, _ in self.parts]} differ, and the Linears fused from them "
                             "share one (GPTQ act-order: q, k and v, or gate and up, must share their g_idx)")
        return arrays[0][index]


class QKVSource:
    """qkv_proj in HF layout, [num_kv_heads * (g + 2) * head_dim, ...], packed from q_proj
    [num_heads * head_dim, ...] and k_proj, v_proj [num_kv_heads * head_dim, ...]: per KV
    head j, the rows of q heads j*g .. j*g + g - 1, then of k head j, then of v head j
    (g = num_heads // num_kv_heads). A read of whole groups, which a device's shard is,
    reads just those heads' rows of each part."""

    def __init__(self, q: TensorSource, k: TensorSource, v: TensorSource, *, num_kv_heads: int):
        self.parts, self.num_groups = (q, k, v), num_kv_heads
        self.shape = (q.shape[0] + k.shape[0] + v.shape[0], *q.shape[1:])

    def __getitem__(self, index: Index) -> np.ndarray:
        rows, rest = index[0], tuple(index[1:])
        start, stop, _ = rows.indices(self.shape[0])
        group_rows = self.shape[0] // self.num_groups
        if start % group_rows or stop % group_rows:
            raise ValueError(f"qkv rows {start}:{stop} are not whole KV-head groups of {group_rows} rows")
        first, last = start // group_rows, stop // group_rows
        pieces = []
        for part in self.parts:
            part_rows = part.shape[0] // self.num_groups  # the part's rows in one group
            piece = np.asarray(part[(slice(first * part_rows, last * part_rows), *rest)])
            pieces.append(piece.reshape(last - first, part_rows, *piece.shape[1:]))
        packed = np.concatenate(pieces, axis=1)  # [groups, (g + 2) * head_dim, ...]
        return packed.reshape(-1, *packed.shape[2:])


class GateUpSource:
    """gate_up_proj in HF layout, [intermediate, 2, hidden], packed from gate_proj and
    up_proj [intermediate, hidden]: a read of some rows reads just those rows of each."""

    def __init__(self, gate: TensorSource, up: TensorSource):
        self.parts = (gate, up)
        self.shape = (gate.shape[0], 2, *gate.shape[1:])

    def __getitem__(self, index: Index) -> np.ndarray:
        rows, which, *rest = index
        return np.stack([np.asarray(part[(rows, *rest)]) for part in self.parts[which]], axis=1)


class StackedGateUpSource:
    """gate_up_proj in HF layout [..., I, 2, H] from one tensor [..., 2I, H] that holds gate's rows, then
    up's (Granite's input_linear, of the stacked experts [E, 2I, H] or a dense MLP): a read of some rows
    reads just those of each half."""

    def __init__(self, stacked: TensorSource):
        *lead, rows, hidden = stacked.shape
        self.stacked, self.half = stacked, rows // 2
        self.shape = (*lead, self.half, 2, hidden)

    def __getitem__(self, index: Index) -> np.ndarray:
        *lead, rows, which, hidden = index
        start, stop, _ = rows.indices(self.half)
        halves = [np.asarray(self.stacked[(*lead, slice(h * self.half + start, h * self.half + stop), hidden)])
                  for h in range(2)[which]]
        return np.stack(halves, axis=-2)


class ExpertsSource:
    """A MoE layer's stacked experts in HF layout, [E, *an expert's shape], from each expert's source:
    a read of some experts reads just those, and of each just the piece asked."""

    def __init__(self, experts: list[TensorSource]):
        self.experts = experts
        self.shape = (len(experts), *experts[0].shape)

    def __getitem__(self, index: Index) -> np.ndarray:
        which, rest = index[0], tuple(index[1:])
        return np.stack([np.asarray(expert[rest]) for expert in self.experts[which]])


class RowsSource:
    """Rows start .. stop of a tensor (a Mamba mixer's B and C rows of in_proj, its x or B and C channels
    of conv1d): a read reads just its piece of those rows."""

    def __init__(self, whole: TensorSource, start: int, stop: int):
        self.whole, self.start = whole, start
        self.shape = (stop - start, *whole.shape[1:])

    def __getitem__(self, index: Index) -> np.ndarray:
        begin, end, _ = index[0].indices(self.shape[0])
        return np.asarray(self.whole[(slice(self.start + begin, self.start + end), *index[1:])])


class MambaHeadsSource:
    """A Mamba mixer's zxdt_proj in HF layout, [heads, 2 * head_dim + 1, ...] from in_proj's rows [z (heads
    * head_dim), x (the same), B and C (bc_rows), dt (heads)]: per head its z rows, its x rows, its dt row.
    A read of some heads reads just those heads' rows of each part."""

    def __init__(self, in_proj: TensorSource, num_heads: int, head_dim: int, bc_rows: int):
        self.in_proj, self.num_heads, self.head_dim = in_proj, num_heads, head_dim
        inner = num_heads * head_dim
        self.starts = (0, inner, 2 * inner + bc_rows)  # z's, x's and dt's first rows
        self.shape = (num_heads, 2 * head_dim + 1, *in_proj.shape[1:])

    def __getitem__(self, index: Index) -> np.ndarray:
        heads, parts, *rest = index
        first, last, _ = heads.indices(self.num_heads)
        p = self.head_dim
        z, x = (np.asarray(self.in_proj[(slice(s + first * p, s + last * p), *rest)]) for s in self.starts[:2])
        dt = np.asarray(self.in_proj[(slice(self.starts[2] + first, self.starts[2] + last), *rest)])
        per_head = [a.reshape(last - first, p, *a.shape[1:]) for a in (z, x)] + [dt[:, None]]
        return np.concatenate(per_head, axis=1)[:, parts]
