"""Structured outputs with llguidance (placeholder until the grammar module lands)."""


def check_structured_outputs(params) -> None:
    raise NotImplementedError("structured outputs are not built yet")
