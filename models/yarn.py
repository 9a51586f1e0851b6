"""YaRN rope scaling (rope_scaling {"rope_type": "yarn", ...}), as HF transformers computes it.

A long context is reached by slowing the rope's low frequencies by `factor` while its high
ones, which turn many times within the original context, stay as trained; a linear ramp over
the rope's dimensions blends the two between `beta_fast` and `beta_slow` turns. Two scales
come with it:
  attention factor  multiplies cos and sin, so the rope parts of q and k (HF's
                    attention_scaling): mscale(factor, mscale) / mscale(factor, mscale_all_dim),
                    or mscale(factor) when the config gives neither
  softmax mscale    DeepSeek's: the softmax scale times mscale(factor, mscale_all_dim) ** 2
with mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1.
"""
import math

import numpy as np


def mscale(factor: float, m: float = 1.0) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> np.ndarray:
    """[dim // 2] float64 inverse frequencies of a rope of `dim` dimensions and base `theta`."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of_turns(turns):  # the dimension whose frequency turns `turns` times over the original context
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of_turns(beta_fast), dim_of_turns(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kept = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)  # 1: as trained, 0: slowed by factor
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def yarn_attention_factor(scaling: dict) -> float:
    """The factor on cos and sin."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def softmax_mscale(scaling: dict | None) -> float:
    """DeepSeek's factor on the softmax scale: mscale(factor, mscale_all_dim) ** 2 (1 without them)."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
