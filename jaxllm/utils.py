"""Small helpers every layer uses."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: cdiv(17, 16) == 2."""
    return -(-a // b)
