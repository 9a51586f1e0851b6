"""SpeculativeConfig: EngineArgs.speculative_config (vLLM's keys) parsed and checked; the draft model or
EAGLE head it names is resolved beside the target by EngineArgs.create_config (config.py)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxllm.models.eagle_config import EAGLE_ARCHITECTURES

if TYPE_CHECKING:
    from jaxllm.config import ModelConfig

EAGLE_METHODS = EAGLE_ARCHITECTURES  # "eagle", "eagle3": the method names its head's architecture
SPECULATIVE_METHODS = ("ngram", "draft_model", *EAGLE_METHODS)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """EngineArgs.speculative_config resolved (vLLM's keys): each decoding request's next
    `num_speculative_tokens` tokens are guessed and the model checks them all in one step."""
    # "ngram": the tokens after the latest earlier copy of the text's last n-gram (spec_decode/ngram.py; under
    # asynchronous scheduling worker/ngram_drafter.py, on the device);
    # "draft_model": a smaller model's greedy tokens (worker/draft_model.py);
    # "eagle", "eagle3": an EAGLE head's greedy tokens, from the target's hidden states (worker/eagle.py)
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: the n-gram's length is the longest in [min, max] that occurs before
    prompt_lookup_max: int = 0
    model: str | None = None  # the draft model or EAGLE head, as EngineArgs.model takes it (an HF folder for a head)
    draft: ModelConfig | None = None  # `model` resolved beside the target (EngineArgs.create_config)

    @classmethod
    def from_dict(cls, spec: dict) -> "SpeculativeConfig":
        """Checked, each bad key named: "speculative_config.num_speculative_tokens must be ...".
        The draft model or head is resolved later, beside the target (EngineArgs.create_config)."""
        known = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
        unknown = sorted(set(spec) - set(known))
        _check(not unknown, f"speculative_config has unknown keys {unknown} (known: {list(known)})")
        model = spec.get("model")
        _check(model is None or isinstance(model, str), f"speculative_config.model must be a str, got {model!r}")
        method = spec.get("method") or ("draft_model" if model else None)  # vLLM's: a model alone is a draft model
        _check(method in SPECULATIVE_METHODS, f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
               f"got {method!r}")
        k = spec.get("num_speculative_tokens")
        _check(_is_int(k) and k >= 1, f"speculative_config.num_speculative_tokens must be an int >= 1, got {k!r}")
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if method != "ngram":
            what = "draft model" if method == "draft_model" else "EAGLE head"
            _check(model is not None, f"speculative_config.model must name the {what} with method {method!r}")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                _check(spec.get(name) is None, f"speculative_config.{name} is for method 'ngram', not {method!r}")
            return cls(method, k, model=model)
        _check(model is None, "speculative_config.model is for a draft model or an EAGLE head, not 'ngram'")
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            _check(value is None or (_is_int(value) and value >= 1),
                   f"speculative_config.{name} must be an int >= 1, got {value!r}")
        # vLLM's defaults: 5 for both, or the one given for the other.
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        _check(low <= high, f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls(method, k, low, high)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
