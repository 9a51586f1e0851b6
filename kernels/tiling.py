"""Helpers the Pallas kernels share: a launch's tiles checked, and fitted to an operand's shape."""
import jax.numpy as jnp


def check_tile_sizes(tiles, names: tuple[str, ...]) -> None:
    """A launch's frozen dataclass: its fields `names` powers of two >= 16 (a tensor-core dot); a
    ValueError naming the field otherwise."""
    for name in names:
        value = getattr(tiles, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{type(tiles).__name__}.{name} must be a power of two >= 16 (a tensor-core dot), "
                             f"got {value}")


def check_tiles(tiles, names: tuple[str, ...]) -> None:
    """check_tile_sizes, and the launch's num_warps 2, 4 or 8 and num_stages 1..8."""
    check_tile_sizes(tiles, names)
    kind = type(tiles).__name__
    if tiles.num_warps not in (2, 4, 8) or not 1 <= tiles.num_stages <= 8:
        raise ValueError(f"{kind}: num_warps in 2, 4, 8 and num_stages in 1..8, got {tiles}")


def divisor(n: int, choices=(64, 32, 16, 8)) -> int:
    """The largest of `choices` that divides n (1 if none does)."""
    return next((c for c in choices if n % c == 0), 1)


def pad_rows(x, multiple: int):
    """x [rows, ...] with zero rows appended up to a multiple of `multiple`."""
    pad = (-x.shape[0]) % multiple
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
