"""The bodies of /v1/embeddings (OpenAI's, with vLLM's extras) and /score (vLLM's), for a server
whose engine pools (jaxllm serve --runner pooling)."""
import time
from typing import Any, ClassVar, Literal

from pydantic import Field

from jaxllm.entrypoints.openai.protocol import Loose, Strict, UsageInfo


class EmbeddingRequest(Strict):
    # A string, a list of strings, a list of token ids or a list of token-id lists, checked by
    # request_body.py before pydantic (as a completion's prompt).
    input: Any
    prompt_field: ClassVar[str] = "input"  # request_body.py's check of prompts
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 values' little-endian bytes
    dimensions: int | None = None  # a Matryoshka model's first values (PoolingParams.dimensions)
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None  # None: the server's pooler_config's (default true)
    add_special_tokens: bool = True


class EmbeddingResponseData(Loose):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class ListResponse(Loose):
    """What /v1/embeddings and /score answer: their data, a list, and the prompt tokens they ran."""
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingResponseData]


class ScoreRequest(Strict):
    """vLLM's: each text_1 scored against its text_2 (1:1, 1:N or N:N) by the cosine similarity of their
    embeddings."""
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None


class ScoreResponseData(Loose):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreResponseData]
