"""Models named by a Hugging Face hub id ("Qwen/Qwen3-0.6B"): a local snapshot folder,
from the hub's cache or downloaded into it.

huggingface_hub does the work (`snapshot_download`): it honours `HF_HUB_OFFLINE` (then
only the cache answers), `HF_HUB_CACHE` / `HF_HOME`, branch and tag names in the
cache's refs/ and commit hashes. Only what the engine reads is fetched: top-level
safetensors, JSON configs and tokenizer files; never pickled .bin/.pt/.pth weights.
"""

# Weights, configs (config.json, generation_config.json, the safetensors index) and
# the tokenizer files transformers reads (tokenizer.json, tokenizer_config.json,
# vocab.json + merges.txt, sentencepiece's tokenizer.model, tiktoken files, a chat template).
MODEL_PATTERNS = ["*.safetensors", "*.json", "*.txt", "tokenizer.model", "*.tiktoken", "*.jinja"]
TOKENIZER_PATTERNS = ["*.json", "*.txt", "tokenizer.model", "*.tiktoken", "*.jinja"]
# Subfolders (Llama's original/ with consolidated .pth files, onnx/, ...) and Mistral's
# consolidated.safetensors, a second copy of the weights in Mistral's own names.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` is a valid hub id, "org/name" or "name" (not a path like "./x" or "a/b/c")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download_snapshot(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None,
                      tokenizer_only: bool = False) -> str:
    """The local folder of `repo_id` at `revision` (a branch, tag or commit; None: main).

    cache_dir: EngineArgs.download_dir, None for the hub's own cache. A repo the hub does
    not have, a revision it lacks, or a repo not cached while offline raise a ValueError
    naming the repo and carrying the hub's message.
    """
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    # Offline, snapshot_download still asks the hub for a commit's file list; local_files_only does not.
    offline = constants.is_offline_mode()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                 allow_patterns=TOKENIZER_PATTERNS if tokenizer_only else MODEL_PATTERNS,
                                 ignore_patterns=IGNORE_PATTERNS)
    # The hub's errors (repo or revision not found, not cached while offline) are OSErrors;
    # httpx's are a proxy's or a connection's.
    except (OSError, httpx.HTTPError) as e:
        what = "tokenizer" if tokenizer_only else "model"
        at = f" at revision {revision!r}" if revision else ""
        if offline and type(e) is LocalEntryNotFoundError:  # its message: unset local_files_only (set by us)
            message = f"not in the cache {cache_dir or constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE is set"
        else:
            message = f"{type(e).__name__}: {' '.join(str(e).split())}"
        raise ValueError(f"{what} {repo_id!r}{at} is neither a local path nor available from the Hugging Face "
                         f"hub ({message})") from e
