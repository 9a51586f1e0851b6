"""The dtypes EngineArgs names (vLLM's): the model's (`dtype`) and the KV cache's (`kv_cache_dtype`)."""
import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# EngineArgs.kv_cache_dtype (vLLM's names) -> CacheConfig.cache_dtype (None: the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn,
                   "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype: str, hf_config: dict, *, platform: str | None = None):
    """EngineArgs.dtype as a jnp dtype; "auto" is float32 on CPU (platform None: JAX's
    default backend), else the checkpoint's dtype with float32 served as bfloat16."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name == "auto":
        if (platform or jax.default_backend()) == "cpu":
            return jnp.float32  # XLA's CPU matmuls are slow and inexact in half precision
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
        name = "bfloat16" if name == "float32" else name  # serve fp32 checkpoints in bf16, as on GPU engines
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[name]
