"""`jaxllm serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over AsyncLLM.

Endpoints: /v1/completions, /v1/chat/completions, /v1/responses (each streams as Server-Sent
Events), GET /v1/responses/{id}, /v1/embeddings and /score (= /v1/score) with --runner pooling,
/v1/models, /tokenize, /detokenize, /health, /version, /metrics (Prometheus), and with
$JAXLLM_ALLOW_RUNTIME_LORA_UPDATING /v1/load_lora_adapter and /v1/unload_lora_adapter
(serving_models.py: LoRA adapters are served under their own model names). With an API key,
every /v1 route needs `Authorization: Bearer KEY`; the others stay open (a load balancer's
health check, a Prometheus scrape). Errors are OpenAI's error JSON.

SIGINT or SIGTERM stops the server in a bounded time: it stops listening, gives the
requests in flight --shutdown-timeout seconds, ends the rest (a stream with an error event
and [DONE]), then shuts the engine core down.
"""
import asyncio
import contextlib
import importlib.metadata
import json
import logging
import resource
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from jaxllm.engine.exceptions import EngineDeadError
from jaxllm.entrypoints.openai.cli_args import (MAX_REQUEST_BODY_BYTES, MAX_SEQS_PER_REQUEST, SHUTDOWN_TIMEOUT_S,
                                                ChatFeatures)
from jaxllm.entrypoints.openai.errors import APIError, engine_dead_error
from jaxllm.entrypoints.openai.metrics import ServerMetrics, log_stats_periodically
from jaxllm.entrypoints.openai.pooling_protocol import EmbeddingRequest, ScoreRequest
from jaxllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                LoadLoRAAdapterRequest, ModelList, TokenizeRequest,
                                                UnloadLoRAAdapterRequest)
from jaxllm.entrypoints.openai.request_body import RequestLimits, parse_request, read_body
from jaxllm.entrypoints.openai.responses_protocol import ResponsesRequest
from jaxllm.entrypoints.openai.serving import MAX_TOKENIZE_TOKENS, OpenAIServing
from jaxllm.entrypoints.openai.serving_chat import ChatServing
from jaxllm.entrypoints.openai.serving_models import ServingModels, runtime_lora_updating
from jaxllm.entrypoints.openai.serving_pooling import PoolingServing
from jaxllm.entrypoints.openai.serving_responses import ResponsesServing

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would sit in every streamed chunk's path)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect API key provided: pass it as `Authorization: Bearer KEY`.",
                                 code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """Run the handler's work, cancelled if the client goes away first: a request that
    waits for its whole output must not run on for nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return Response(status_code=499)  # the client is gone: nobody reads this
    return task.result()


class _EventStreamResponse(StreamingResponse):
    """Server-Sent Events whose stream is cancelled when the client goes away. Starlette's
    own cancellation (its task group's cancel scope) was seen not to reach a stream task
    under load (20 concurrent streams on two CPU cores): the stream ran to its end, for
    nobody. A plain task.cancel() does."""

    async def stream_response(self, send) -> None:
        self._stream_task = asyncio.current_task()
        await super().stream_response(send)

    async def listen_for_disconnect(self, receive) -> None:
        await super().listen_for_disconnect(receive)
        task = getattr(self, "_stream_task", None)
        if task is not None and not task.done():
            task.cancel()


def _respond(result):
    if isinstance(result, Response):
        return result
    if hasattr(result, "__aiter__"):
        return _EventStreamResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


def _error_response(error: APIError) -> Response:
    # ASCII JSON: whatever a message quotes, its response can be encoded.
    return Response(json.dumps(error.body()), status_code=error.status, media_type="application/json")


def build_app(engine, model_names: list[str], api_key: str | None = None, chat_template: str | None = None,
              max_log_len: int | None = None, max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
              max_seqs_per_request: int = MAX_SEQS_PER_REQUEST, features: ChatFeatures = ChatFeatures(),
              lora_modules: list[tuple[str, str]] = ()) -> FastAPI:
    """lora_modules: (name, path) of the LoRA adapters served under their own model names."""
    models = ServingModels(engine, model_names, lora_modules)
    lora, moe = engine.config.lora, engine.config.model.arch.moe
    metrics = ServerMetrics(model_names[0], engine.config.model.max_model_len, lora.max_loras if lora else 0,
                            moe.sparse_layers if moe else ())
    engine.stats_listeners.append(metrics.record_scheduler_stats)
    serving = OpenAIServing(engine, models, metrics, chat_template, max_log_len, max_seqs_per_request)
    chat = ChatServing(serving, features)
    responses = ResponsesServing(chat, features.max_stored_responses)
    pooling = PoolingServing(serving)
    limits = RequestLimits(max_request_body_bytes, max_seqs_per_request, engine.config.model.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.ensure_future(log_stats_periodically(engine, metrics))
        try:
            yield
        finally:
            task.cancel()
            serving.close()
            engine.shutdown()  # here, not after uvicorn returns: it re-raises a SIGTERM, which ends the process

    app = FastAPI(title="jaxllm", lifespan=lifespan)
    app.state.serving = serving
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    async def body_as(request: Request, model):
        """The request's body as `model`: read here, parsed and checked in a worker thread."""
        body = await read_body(request, limits.max_body_bytes)
        return await serving.in_worker(parse_request, body, model, limits)

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):  # an unknown route, a wrong method
        return _error_response(APIError(error.status_code, str(error.detail), type="invalid_request_error"))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request, error: EngineDeadError):
        return _error_response(engine_dead_error())

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_as(request, CompletionRequest)
        return _respond(await _unless_disconnected(request, serving.create_completion(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_as(request, ChatCompletionRequest)
        return _respond(await _unless_disconnected(request, chat.create_chat_completion(body)))

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await body_as(request, ResponsesRequest)
        return _respond(await _unless_disconnected(request, responses.create_response(body)))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return JSONResponse(responses.get_response(response_id))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await body_as(request, EmbeddingRequest)
        return _respond(await _unless_disconnected(request, pooling.create_embedding(body)))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request):
        body = await body_as(request, ScoreRequest)
        return _respond(await _unless_disconnected(request, pooling.create_score(body)))

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(ModelList(data=models.cards()).model_dump())

    if runtime_lora_updating():
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            return Response(await models.load_lora_adapter(await body_as(request, LoadLoRAAdapterRequest)))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return Response(await models.unload_lora_adapter(await body_as(request, UnloadLoRAAdapterRequest)))

    def tokenize_response(body: TokenizeRequest) -> Response:
        if body.messages is not None:
            _, tokens = chat.chat_prompt(body)
        else:
            tokens = serving.tokenize_text(body.prompt, "prompt", body.add_special_tokens, MAX_TOKENIZE_TOKENS)
        content = {"count": len(tokens), "max_model_len": engine.config.model.max_model_len, "tokens": tokens}
        return Response(json.dumps(content), media_type="application/json")  # a long list: in the worker too

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_as(request, TokenizeRequest)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "set exactly one of prompt and messages", param="prompt")
        return await serving.in_worker(tokenize_response, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_as(request, DetokenizeRequest)
        serving.check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this server's engine was started with skip_tokenizer_init: it has no tokenizer",
                           param="tokens")
        vocab_size = engine.config.model.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                           param="tokens")
        return {"prompt": await serving.in_worker(engine.tokenizer.decode, body.tokens)}

    @app.get("/health")
    async def health():
        if engine.errored:
            raise engine_dead_error()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("jaxllm")}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _raise_open_file_limit() -> None:
    """Each connection is a file descriptor: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def configure_logging() -> None:
    """jaxllm's INFO lines (requests, stats) beside uvicorn's, unless the caller set up logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("jaxllm").setLevel(logging.INFO)


def run_server(engine, model_names: list[str], host: str, port: int, api_key: str | None = None,
               chat_template: str | None = None, max_log_len: int | None = None,
               uvicorn_log_level: str = "info", max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
               max_seqs_per_request: int = MAX_SEQS_PER_REQUEST,
               shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S, features: ChatFeatures = ChatFeatures(),
               lora_modules: list[tuple[str, str]] = ()) -> None:
    """Serve the engine until interrupted (SIGINT, SIGTERM); the engine is shut down then."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's shutdown stops listening, then waits for every connection to close,
        streams included, for as long as they run: here they get shutdown_timeout_s."""

        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(app.state.serving.drain(shutdown_timeout_s))
            try:
                await super().shutdown(sockets)
            finally:
                drain.cancel()

    _raise_open_file_limit()
    try:
        app = build_app(engine, model_names, api_key, chat_template, max_log_len, max_request_body_bytes,
                        max_seqs_per_request, features, lora_modules)
        logger.info("serving %s on http://%s:%d", ", ".join(model_names), host, port)
        # uvicorn's own deadline is a backstop: past it, it cancels what still runs.
        config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level, timeout_keep_alive=5,
                                backlog=4096, timeout_graceful_shutdown=shutdown_timeout_s + 5)
        Server(config).run()
    except KeyboardInterrupt:
        pass  # uvicorn handled the SIGINT (the server has shut down), then raised it again
    finally:
        engine.shutdown()
