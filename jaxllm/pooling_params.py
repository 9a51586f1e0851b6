"""PoolingParams: how one pooling request's vector is made (vLLM's fields for embeddings), and
PoolerConfig: how every pooling request of an engine is pooled (EngineArgs.pooler_config).

A pooling request runs on an engine started with runner="pooling": its prompt is prefilled
like any other, and instead of sampling it ends with one vector, the final hidden states of
its prompt pooled as the engine's PoolerConfig says (worker/pooler.py)."""
import dataclasses

from jaxllm.sampling_params import SamplingParams
from jaxllm.typecheck import check_field_types


@dataclasses.dataclass
class PoolingParams:
    # Matryoshka: keep the pooled vector's first `dimensions` values (before normalizing). Only for
    # a model whose config.json allows it (is_matryoshka, or matryoshka_dimensions listing this one).
    dimensions: int | None = None
    # Divide the vector by its L2 norm; None: the engine's pooler_config.normalize (default True).
    normalize: bool | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and range, naming the field. The engine calls it again, as params
        are mutable; what depends on the model (dimensions) the engine's Processor checks."""
        check_field_types(self)
        if self.dimensions is not None and not 1 <= self.dimensions < 2**31:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """EngineArgs.pooler_config resolved (vLLM's keys): how a pooling request's prompt becomes one
    vector. vLLM's defaults for a decoder used as an embedding model: the last token, normalized."""
    # Of the final hidden states (the model's last norm applied, before the LM head): "LAST" the
    # prompt's last token's, "MEAN" the mean over its tokens, "CLS" its first token's.
    pooling_type: str = "LAST"
    normalize: bool = True  # PoolingParams.normalize's default: divide the vector by its L2 norm

    @classmethod
    def from_dict(cls, fields: dict) -> "PoolerConfig":
        """Checked, each bad key named: "pooler_config.pooling_type must be ..."."""
        unknown = sorted(set(fields) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config has unknown keys {unknown} (known: ['pooling_type', 'normalize'])")
        config = cls(**fields)
        if config.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES}, "
                             f"got {config.pooling_type!r}")
        if not isinstance(config.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a bool, got {config.normalize!r}")
        return config

    @property
    def reads_every_token(self) -> bool:
        """Whether the vector reads prompt tokens before the last: then none of them may come from the
        prefix cache (their hidden states were never computed)."""
        return self.pooling_type != "LAST"


# What a pooling request carries through the engine core as its SamplingParams: the scheduler and
# the runner make a row of sampling words for every request they run, and a pooling request never
# samples (it ends at its prompt's end). Greedy and one token: the cheapest words a batch can hold.
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
