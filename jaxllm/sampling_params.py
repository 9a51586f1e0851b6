"""SamplingParams: how one request is sampled and when it stops (vLLM's fields)."""
import dataclasses
import enum
import math


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every step: everything generated so far
    DELTA = 1       # every step: only what is new
    FINAL_ONLY = 2  # once, when the request finishes (what LLM.generate uses)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self):
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported yet), got {self.n}")
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.max_tokens is not None and not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
