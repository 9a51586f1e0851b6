"""Helpers the matmul kernels share to fit a launch's tiles to an operand's shape."""
import jax.numpy as jnp


def divisor(n: int, choices=(64, 32, 16, 8)) -> int:
    """The largest of `choices` that divides n (1 if none does)."""
    return next((c for c in choices if n % c == 0), 1)


def pad_rows(x, multiple: int):
    """x [rows, ...] with zero rows appended up to a multiple of `multiple`."""
    pad = (-x.shape[0]) % multiple
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
