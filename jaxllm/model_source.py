"""Where a model's files come from: an HF folder, a .gguf file, an orbax folder from `jaxllm
convert`, a Hugging Face hub id (downloaded to its snapshot's folder), or a bundled config
(load_format="dummy"). Each resolves to a path, its format and an HF-style config dict."""
import importlib.resources
import json
import os

from jaxllm.models.config import ModelArchConfig


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def bundled_model_configs() -> list[str]:
    """Names of the model configs shipped in jaxllm.models.configs (for load_format="dummy")."""
    files = importlib.resources.files("jaxllm.models.configs").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def resolve_model(model: str | None, load_format: str, revision: str | None = None,
                  download_dir: str | None = None) -> tuple[str, str, dict, ModelArchConfig]:
    """(path, format, HF-style config dict, architecture); a file that cannot be read or
    parsed raises a ValueError naming it. A hub id resolves to its snapshot's folder."""
    path, fmt, hf_config, source = locate_model(model, load_format, revision, download_dir)
    try:
        return path, fmt, hf_config, ModelArchConfig.from_hf_config(hf_config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def locate_model(model: str | None, load_format: str, revision: str | None = None,
                 download_dir: str | None = None) -> tuple[str, str, dict, str]:
    """(path, format, HF-style config dict, where that config came from), the config not parsed."""
    from jaxllm import model_hub
    from jaxllm.models import gguf
    from jaxllm.models.orbax_checkpoint import is_orbax_checkpoint
    if model is None:
        model = gguf.find_default_model()
    if (not os.path.exists(model) and model not in bundled_model_configs()
            and model_hub.looks_like_repo_id(model)):
        snapshot = model_hub.download_snapshot(model, revision=revision, cache_dir=download_dir)
        _check(os.path.isfile(os.path.join(snapshot, "config.json")),
               f"hub model {model!r} has no config.json (only HF safetensors repos load by id; "
               "for a GGUF repo download its .gguf file and pass its path)")
        model = snapshot
    if os.path.isfile(model) and model.endswith(".gguf"):
        fmt, source, hf_config = "gguf", model, gguf.load_gguf_config(model)
    elif os.path.isdir(model):
        fmt, source = ("orbax" if is_orbax_checkpoint(model) else "hf"), os.path.join(model, "config.json")
        _check(os.path.isfile(source), f"model folder {model!r} has no config.json")
        hf_config = read_json(source)
    elif model in bundled_model_configs():
        _check(load_format == "dummy",
               f"model {model!r} is a bundled config without weights: use load_format='dummy'")
        fmt, source = "bundled", f"bundled config {model!r}"
        text = importlib.resources.files("jaxllm.models.configs").joinpath(f"{model}.json").read_text()
        hf_config = json.loads(text)
    else:
        raise ValueError(f"model {model!r} not found: pass an HF folder with config.json, a .gguf file, "
                         f"an orbax folder from `jaxllm convert`, a Hugging Face hub id, "
                         f"or with load_format='dummy' one of {bundled_model_configs()}")
    return model, fmt, hf_config, source


def tensor_names(path: str) -> set[str]:
    """The names of an HF folder's safetensors tensors (their headers only are read)."""
    from jaxllm.models.hf_checkpoint import iter_hf_weights
    return {name for name, _ in iter_hf_weights(path)}


def resolve_tokenizer(tokenizer: str | None, revision: str | None, download_dir: str | None) -> str | None:
    """EngineArgs.tokenizer as a local HF folder or .gguf file (a hub id: its snapshot's folder)."""
    if tokenizer is None or os.path.isdir(tokenizer) or (os.path.isfile(tokenizer) and tokenizer.endswith(".gguf")):
        return tokenizer
    from jaxllm import model_hub
    _check(not os.path.exists(tokenizer) and model_hub.looks_like_repo_id(tokenizer),
           f"tokenizer must be an HF folder, a .gguf file or a hub id, got {tokenizer!r}")
    return model_hub.download_snapshot(tokenizer, revision=revision, cache_dir=download_dir, tokenizer_only=True)


def read_json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from e
