"""`jaxllm serve`'s own flags (beside EngineArgs'), importable without the serve extra."""
import argparse
import dataclasses
import json
import os

from jaxllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

MAX_REQUEST_BODY_BYTES = 16 << 20  # a 128k-token prompt, as text or token ids, is about 1 MB
MAX_SEQS_PER_REQUEST = 1024
SHUTDOWN_TIMEOUT_S = 5.0
MAX_STORED_RESPONSES = 1000


@dataclasses.dataclass(frozen=True)
class ChatFeatures:
    """What serve's flags turn on for chat and responses: tool calling, a reasoning parser (with
    its </think> token id, from the model's vocabulary) and the responses kept for
    previous_response_id."""
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    reasoning_end_token_id: int | None = None
    max_stored_responses: int = MAX_STORED_RESPONSES

    def __post_init__(self):
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: it reads the calls in the output")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if (self.reasoning_parser is None) != (self.reasoning_end_token_id is None):
            raise ValueError("a reasoning parser goes with the id of its </think> token")
        if self.max_stored_responses < 0:
            raise ValueError(f"--max-stored-responses must be >= 0, got {self.max_stored_responses}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $JAXLLM_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model's name(s) in the API; the first is the one reported "
                             "(default: the model argument)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="log at most this many prompt characters or token ids per request (default: all)")
    parser.add_argument("--max-request-body-bytes", type=_positive(int), default=MAX_REQUEST_BODY_BYTES,
                        help="refuse (413) a request body larger than this (default: 16 MiB)")
    parser.add_argument("--max-seqs-per-request", type=_positive(int), default=MAX_SEQS_PER_REQUEST,
                        help="the most sequences one request may start: its prompts times n (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=_positive(float), default=SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGINT or SIGTERM, how long requests in flight may still run before they are "
                             "ended (default: %(default)s)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model call tools when it chooses (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="how the model writes tool calls (hermes: also Qwen2.5 and Qwen3)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split a reasoning model's thinking (reasoning_content) from its answer")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) served under their own model names, as name=path or "
                             'vLLM\'s JSON {"name": ..., "path": ...}; needs --enable-lora')
    parser.add_argument("--max-stored-responses", type=int, default=MAX_STORED_RESPONSES, metavar="N",
                        help="/v1/responses kept in memory for previous_response_id and GET, the least recently "
                             "used dropped first (default: %(default)s)")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' item: name=path, or a JSON object with "name" and "path" -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
        name, path = item.get("name"), item.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or {{\"name\": ..., \"path\": ...}}, got {text!r}")
    return name, path


def served_model_names(ns: argparse.Namespace, model_path: str) -> list[str]:
    if ns.served_model_name:
        return list(ns.served_model_name)
    return [ns.model or os.path.basename(model_path).removesuffix(".gguf")]
