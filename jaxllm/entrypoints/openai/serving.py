"""The OpenAI endpoints' work: a request body -> prompts and SamplingParams -> AsyncLLM ->
a response body, or Server-Sent Events (`data: {json}` lines ending in `data: [DONE]`).

Every check of the input happens before the response starts, so a bad request is a 400
with OpenAI's error JSON, never a broken stream: the prompts are tokenized here, and each
request's first output is awaited before the stream's headers go out. Leaving a stream
early (the client went away) closes the engine's generator, which aborts the request.

Work that grows with the request (parsing its body, the chat template, tokenizing, building
its grammar) runs in worker threads (`in_worker`), so that one large request leaves the
event loop, and so every stream and /health, free.
"""
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator

from jaxllm.engine.exceptions import EngineDeadError
from jaxllm.entrypoints.openai.errors import APIError, bad_request, engine_dead_error, shutdown_error
from jaxllm.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from jaxllm.entrypoints.openai.prompts import PromptEncoder, PromptTooLong
from jaxllm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                CompletionResponse, SamplingRequest, UsageInfo, random_id)
from jaxllm.entrypoints.openai.request_streams import RequestFailed, RequestStreams, ServerShuttingDown
from jaxllm.entrypoints.openai.serving_models import ServingModels
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DEFAULT_PARAMS = SamplingParams()  # the request log shows only the fields that differ
# Threads for the work that grows with a request. The tokenizer lets go of the interpreter
# while it encodes, so a few run in parallel; a request's parse and checks take turns with
# the event loop's thread, which keeps /health answering under a large one.
_WORKER_THREADS = 4
# /tokenize counts texts longer than max_model_len (jaxllm bench serve measures datasets with
# it), up to this many tokens: their list and its JSON take ~0.1 s of the interpreter per million.
MAX_TOKENIZE_TOKENS = 2**20


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def error_event(error: APIError) -> str:
    return sse(json.dumps(error.body()))


STREAM_ENDINGS = (RequestFailed, EngineDeadError, ServerShuttingDown)  # what ends a stream with an error


def stream_error(e: Exception) -> APIError:
    """The error a stream ended by one of STREAM_ENDINGS reports."""
    if isinstance(e, EngineDeadError):
        return engine_dead_error()
    if isinstance(e, ServerShuttingDown):
        return shutdown_error()
    return APIError(500, f"the engine failed the request: {e}")


async def sse_events(events: AsyncIterator[str], requests: RequestStreams) -> AsyncIterator[str]:
    """A stream's events, then [DONE]; one of STREAM_ENDINGS ends it early with an error event. Its
    requests are closed whatever happens, also when the client leaves (the server closes this
    stream at a yield)."""
    try:
        async for event in events:
            yield event
    except STREAM_ENDINGS as e:
        yield error_event(stream_error(e))
    finally:
        requests.close()
        await events.aclose()
    yield sse("[DONE]")


def token_text(token_id: int, logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


class OpenAIServing:
    def __init__(self, engine, models: ServingModels, metrics: ServerMetrics,
                 chat_template: str | None, max_log_len: int | None, max_seqs_per_request: int):
        self.engine = engine
        self.models = models  # the base model's names and the LoRA adapters'
        self.model_names = models.base_names
        self.metrics = metrics
        self.chat_template = chat_template
        self.max_log_len = max_log_len
        self.max_seqs_per_request = max_seqs_per_request
        self.max_model_len = engine.config.model.max_model_len
        self.default_fields = dict(engine.default_sampling_fields)
        self.encoder = None if engine.tokenizer is None else PromptEncoder(engine.tokenizer, self.max_model_len)
        self._workers = concurrent.futures.ThreadPoolExecutor(_WORKER_THREADS, thread_name_prefix="jaxllm-request")
        self._running: weakref.WeakSet[RequestStreams] = weakref.WeakSet()
        self.draining = False

    async def in_worker(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args, **kwargs))

    # ---- shutdown ----
    async def drain(self, timeout_s: float) -> None:
        """Shutting down: new requests get a 503 at once; those in flight have timeout_s to
        finish, then are ended (a stream with an error event and [DONE], a whole response
        with a 503) and aborted in the engine. The server cancels this once every
        connection has closed."""
        self.draining = True
        await asyncio.sleep(timeout_s)
        for requests in list(self._running):
            requests.stop()

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    # ---- shared checks ----
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); an unknown name is a 404."""
        return self.models.lora_request(name)

    @staticmethod
    def check_stream_options(request: SamplingRequest) -> None:
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only for a streamed request (stream: true)", param="stream_options")

    def check_alive(self) -> None:
        if self.engine.errored:
            raise engine_dead_error()
        if self.draining:
            raise shutdown_error()

    def tokenize_text(self, text: str, field: str, add_special_tokens: bool = True,
                      max_tokens: int | None = None) -> list[int]:
        """In a worker thread. At most max_tokens tokens (default max_model_len)."""
        if self.encoder is None:
            raise APIError(400, "text prompts need a tokenizer, and this server's engine was started with "
                           "skip_tokenizer_init: send token ids", param=field)
        try:
            return self.encoder.encode(text, add_special_tokens, max_tokens)
        except PromptTooLong as e:
            raise self.too_long(e, field, max_tokens or self.max_model_len, len(text)) from None

    def too_long(self, error: PromptTooLong, field: str, max_tokens: int, num_chars: int) -> APIError:
        size = f"{num_chars} characters" if error.num_tokens is None else f"{error.num_tokens} tokens"
        limit = (f"This model's maximum context length is {max_tokens} tokens" if max_tokens == self.max_model_len
                 else f"The server tokenizes at most {max_tokens} tokens")
        return APIError(400, f"{limit}, and the {field} has {size}: more than that. Please shorten the {field}.",
                        param=field)

    def max_tokens(self, requested: int | None, field: str, num_prompt_tokens: int, prompt_field: str,
                   default: int | None) -> int:
        """What the request may generate: max_model_len bounds prompt + output."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and the "
                           f"prompt has {num_prompt_tokens}: no room is left for output. Please shorten the "
                           f"{prompt_field}.", param=prompt_field)
        if requested is None:
            return min(room, default or room)
        if requested < 1:
            raise APIError(400, f"{field} must be >= 1, got {requested}", param=field)
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                           f"{prompt_field}, {requested} in the completion). Please reduce the {prompt_field} or "
                           f"{field}.", param=field)
        return requested

    def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None,
                        output_kind: RequestOutputKind, **overrides) -> SamplingParams:
        """The request's SamplingParams; `overrides` set fields the caller decides (chat's tool
        choice and tool parser decide structured_outputs and skip_special_tokens)."""
        fields = {k: v for k, v in self.default_fields.items() if k != "max_tokens"}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "seed", "min_tokens", "ignore_eos", "stop_token_ids",
                     "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "logit_bias", "allowed_token_ids", "bad_words"):
            if getattr(request, name) is not None:
                fields[name] = getattr(request, name)
        fields.update(overrides)
        if "structured_outputs" not in fields:
            fields["structured_outputs"] = self.structured_outputs(request)
        try:
            return SamplingParams(n=request.n, max_tokens=max_tokens, logprobs=logprobs, output_kind=output_kind,
                                  **fields)
        except (ValueError, TypeError) as e:
            raise bad_request(e, type(request).model_fields) from e

    @staticmethod
    def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
        """response_format (OpenAI's) or structured_outputs (vLLM's) as the engine's params."""
        fmt, so = request.response_format, request.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise APIError(400, "set response_format or structured_outputs, not both", param="response_format")
        try:
            if so is not None:
                return StructuredOutputsParams(**so.model_dump(exclude_none=True, by_alias=True))
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        except (ValueError, TypeError) as e:
            param = "structured_outputs" if so is not None else "response_format"
            message = str(e) if str(e).startswith(param) else f"{param}: {e}"
            raise APIError(400, message, param=param) from e

    def log_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if logger.isEnabledFor(logging.INFO):
            shown = prompt if self.max_log_len is None else prompt[:self.max_log_len]
            changed = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                       if getattr(params, f.name) != getattr(_DEFAULT_PARAMS, f.name)}
            logger.info("Received request %s: prompt: %r, params: %s", request_id, shown, changed)

    # ---- running requests ----
    async def _outputs(self, request_id: str, prompt: dict, params: SamplingParams, tracker: RequestTracker,
                       lora_request: LoRARequest | None) -> AsyncIterator[RequestOutput]:
        """The engine's outputs of one request, counted in the metrics. Closing this
        generator before the last output aborts the request in the engine."""
        default_reason = "abort"
        try:
            async with contextlib.aclosing(self.engine.generate(prompt, params, request_id, lora_request)) as outputs:
                async for out in outputs:
                    tracker.update(out)
                    yield out
        except EngineDeadError:
            default_reason = "error"
            raise
        except (ValueError, TypeError):
            tracker.reject()
            raise
        finally:
            tracker.finish(default_reason)

    def start(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
              max_tokens: int, lora_request: LoRARequest | None = None) -> RequestStreams:
        self.check_alive()  # again: the engine may have died, or a shutdown begun, while it was prepared
        streams = []
        for i, (text, token_ids) in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            self.log_request(rid, text if text is not None else token_ids, params)
            prompt = {"prompt_token_ids": token_ids} if text is None else {"prompt": text,
                                                                          "prompt_token_ids": token_ids}
            streams.append(self._outputs(rid, prompt, params, RequestTracker(self.metrics, params.n, max_tokens),
                                         lora_request))
        requests = RequestStreams(streams)
        self._running.add(requests)
        return requests

    def start_pooling(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                      params: PoolingParams) -> RequestStreams:
        """As `start`, for pooling requests (AsyncLLM.encode): one output each."""
        self.check_alive()
        streams = [self.engine.encode({"prompt_token_ids": token_ids}, params, f"{request_id}-{i}")
                   for i, (_, token_ids) in enumerate(prompts)]
        requests = RequestStreams(streams)
        self._running.add(requests)
        return requests

    @staticmethod
    async def first_outputs(requests: RequestStreams, fields) -> list[RequestOutput]:
        """Each request's first output (for FINAL_ONLY, its only one). The engine's own checks
        (vocabulary, logprobs limit, ...) fail here, before any response starts."""
        try:
            return await requests.first_outputs()
        except EngineDeadError as e:
            raise engine_dead_error() from e
        except ServerShuttingDown as e:
            raise shutdown_error() from e
        except (ValueError, TypeError) as e:
            raise bad_request(e, fields) from e

    def check_num_seqs(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_seqs_per_request:
            raise APIError(400, f"n ({n}) times the {num_prompts} prompt(s) is {num_prompts * n} sequences, more than "
                           f"a request may start ({self.max_seqs_per_request}: jaxllm serve --max-seqs-per-request)",
                           param="n")

    def tokenized_prompts(self, prompt, field: str, n: int = 1,
                          add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
        """In a worker thread: a completion's prompt or an embedding's input (its shape checked in
        request_body.py), as (its text or None, its token ids) per prompt."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, f"{field} is empty", param=field)
        self.check_num_seqs(len(prompt), n)
        prompts = []
        for p in prompt:
            token_ids = self.tokenize_text(p, field, add_special_tokens) if isinstance(p, str) else list(p)
            if not token_ids:
                raise APIError(400, f"{field} is empty: it must hold at least one token", param=field)
            prompts.append((p if isinstance(p, str) else None, token_ids))
        return prompts

    # ---- /v1/completions ----
    async def create_completion(self, request: CompletionRequest):
        """A CompletionResponse, or for stream=true an async iterator of SSE lines."""
        lora_request = self.check_model(request.model)
        self.check_stream_options(request)
        self.check_alive()
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(400, f"best_of must equal n ({request.n}) or be unset, got {request.best_of}: the "
                           "engine has no candidates to pick the best of", param="best_of")
        if request.echo and request.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's logprobs, which the server does not "
                           "return yet", param="echo")
        prompts, max_tokens, params = await self.in_worker(self._prepare_completion, request)
        request_id = random_id("cmpl")
        model = request.model or self.model_names[0]
        requests = self.start(request_id, prompts, params, max_tokens, lora_request)
        firsts = await self.first_outputs(requests, CompletionRequest.model_fields)
        if request.stream:
            return sse_events(self._completion_stream(request, request_id, model, prompts, requests), requests)
        requests.close()
        choices = []
        for i, out in enumerate(firsts):
            if out.error is not None:
                raise APIError(500, f"the engine failed the request: {out.error}")
            for c in sorted(out.outputs, key=lambda c: c.index):
                text = (prompts[i][0] or "") + c.text if request.echo else c.text
                logprobs = None if c.logprobs is None else self._completion_logprobs(c, 0)
                choices.append(CompletionChoice(index=i * request.n + c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        completion_tokens = sum(len(c.token_ids) for out in firsts for c in out.outputs)
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                                  total_tokens=prompt_tokens + completion_tokens))

    def _prepare_completion(self, request: CompletionRequest):
        """In a worker thread: the prompts, max_tokens and SamplingParams (its grammar compiled)."""
        prompts = self.tokenized_prompts(request.prompt, "prompt", request.n)
        longest = max(len(ids) for _, ids in prompts)
        max_tokens = self.max_tokens(request.max_tokens, "max_tokens", longest, "prompt",
                                     self.default_fields.get("max_tokens") or _COMPLETION_DEFAULT_MAX_TOKENS)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        return prompts, max_tokens, self.sampling_params(request, max_tokens, request.logprobs, kind)

    @staticmethod
    def _completion_logprobs(c: CompletionOutput, text_offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, entries in zip(c.token_ids, c.logprobs):
            sampled = entries[token_id]
            text = token_text(token_id, sampled)
            result.tokens.append(text)
            result.token_logprobs.append(sampled.logprob)
            result.top_logprobs.append({token_text(t, lp): lp.logprob for t, lp in entries.items()})
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result

    async def _completion_stream(self, request: CompletionRequest, request_id: str, model: str, prompts,
                                 requests: RequestStreams) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        completion_tokens = 0
        echoed: set[int] = set()
        text_offsets: dict[int, int] = {}
        async for i, out in requests:
            if out.error is not None:
                raise RequestFailed(out.error)
            for c in out.outputs:
                index = i * request.n + c.index
                completion_tokens += len(c.token_ids)
                text = c.text
                if request.echo and index not in echoed:
                    echoed.add(index)
                    text = (prompts[i][0] or "") + text
                logprobs = None
                if c.logprobs is not None:
                    logprobs = self._completion_logprobs(c, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(c.text)
                if not text and c.finish_reason is None and not c.token_ids:
                    continue
                usage = None
                if continuous:
                    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                      total_tokens=prompt_tokens + completion_tokens)
                chunk = CompletionResponse(
                    id=request_id, created=created, model=model, usage=usage,
                    choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
                yield sse(chunk.model_dump_json())
        if include_usage:
            usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=prompt_tokens + completion_tokens)
            chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
            yield sse(chunk.model_dump_json())
