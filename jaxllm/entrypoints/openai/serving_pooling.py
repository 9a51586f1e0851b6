"""/v1/embeddings and /score, on a server whose engine pools (jaxllm serve --runner pooling): the
texts tokenized and checked in a worker thread, one pooling request per text (AsyncLLM.encode), and
back OpenAI's vectors (floats, or base64: the float32 values' little-endian bytes, as OpenAI's) or
a score per pair, the cosine similarity of its two vectors (score_utils.py). A server that only
generates answers both with a 400, as vLLM's does."""
import base64

import numpy as np

from jaxllm.entrypoints.openai.errors import APIError, bad_request
from jaxllm.entrypoints.openai.pooling_protocol import (EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData,
                                                        ScoreRequest, ScoreResponse, ScoreResponseData)
from jaxllm.entrypoints.openai.protocol import UsageInfo, random_id
from jaxllm.entrypoints.openai.serving import OpenAIServing
from jaxllm.entrypoints.score_utils import check_score_inputs, cosine_scores
from jaxllm.outputs import PoolingRequestOutput
from jaxllm.pooling_params import PoolingParams


class PoolingServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self._check(request.model, "Embeddings")
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        except ValueError as e:
            raise bad_request(e, EmbeddingRequest.model_fields) from e
        prompts = await self.serving.in_worker(self.serving.tokenized_prompts, request.input, "input",
                                               add_special_tokens=request.add_special_tokens)
        request_id = random_id("embd")
        outputs = await self._pool(request_id, prompts, params, EmbeddingRequest.model_fields)
        data = [EmbeddingResponseData(index=i, embedding=_encoded(out.outputs.data, request.encoding_format))
                for i, out in enumerate(outputs)]
        num_tokens = sum(len(token_ids) for _, token_ids in prompts)
        return EmbeddingResponse(id=request_id, model=request.model or self.serving.model_names[0], data=data,
                                 usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        self._check(request.model, "Score")
        texts_1, texts_2 = ([text] if isinstance(text, str) else text for text in (request.text_1, request.text_2))
        try:
            check_score_inputs(len(texts_1), len(texts_2))
        except ValueError as e:
            raise bad_request(e, ScoreRequest.model_fields) from e
        prompts_1 = await self.serving.in_worker(self.serving.tokenized_prompts, texts_1, "text_1")
        prompts_2 = await self.serving.in_worker(self.serving.tokenized_prompts, texts_2, "text_2")
        request_id = random_id("score")
        outputs = await self._pool(request_id, prompts_1 + prompts_2, PoolingParams(), ScoreRequest.model_fields)
        pad_token_id = getattr(self.engine.tokenizer, "pad_token_id", None)
        scores = cosine_scores(outputs[:len(prompts_1)], outputs[len(prompts_1):], pad_token_id)
        num_tokens = sum(len(s.prompt_token_ids) for s in scores)  # as vLLM counts: each pair's
        return ScoreResponse(id=request_id, model=request.model or self.serving.model_names[0],
                             data=[ScoreResponseData(index=i, score=s.outputs.score) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))

    def _check(self, model: str | None, api: str) -> None:
        if self.serving.check_model(model) is not None:
            raise APIError(400, f"The {api} API runs on the base model, not on a LoRA adapter ({model!r})",
                           param="model")
        self.serving.check_alive()
        if self.engine.config.model.pooler_config is None:
            raise APIError(400, f"The model does not support the {api} API: this server's engine generates only "
                           "(start it with --runner pooling)")

    async def _pool(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: PoolingParams,
                    fields) -> list[PoolingRequestOutput]:
        requests = self.serving.start_pooling(request_id, prompts, params)
        outputs = await self.serving.first_outputs(requests, fields)
        requests.close()
        for out in outputs:
            if out.error is not None:
                raise APIError(500, f"the engine failed the request: {out.error}")
        return outputs


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
