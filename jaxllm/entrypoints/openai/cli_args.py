"""`jaxllm serve`'s own flags (beside EngineArgs'), importable without the serve extra."""
import argparse
import os

MAX_REQUEST_BODY_BYTES = 16 << 20  # a 128k-token prompt, as text or token ids, is about 1 MB
MAX_SEQS_PER_REQUEST = 1024
SHUTDOWN_TIMEOUT_S = 5.0


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


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def served_model_names(ns: argparse.Namespace, model_path: str) -> list[str]:
    if ns.served_model_name:
        return list(ns.served_model_name)
    return [ns.model or os.path.basename(model_path).removesuffix(".gguf")]
