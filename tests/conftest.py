import os

import jax
import pytest

# Tests compile on a 2-core CPU: keep compiled executables between runs, in the checkout.
os.environ.setdefault("JAXLLM_COMPILATION_CACHE",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def tiny_model(name: str) -> str:
    return os.path.join(FIXTURES, "tiny", name)


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
