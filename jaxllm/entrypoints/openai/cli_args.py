"""`jaxllm serve`'s own flags (beside EngineArgs'), importable without the serve extra."""
import argparse
import os


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


def served_model_names(ns: argparse.Namespace, model_path: str) -> list[str]:
    if ns.served_model_name:
        return list(ns.served_model_name)
    return [ns.model or os.path.basename(model_path).removesuffix(".gguf")]
