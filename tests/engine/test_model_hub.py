"""Models by Hugging Face hub id, from a fake hub cache in a temp folder and
offline: never the network."""
import os
import shutil
import subprocess
import sys

import pytest

from jaxllm import EngineArgs
from jaxllm.model_hub import IGNORE_PATTERNS, MODEL_PATTERNS, TOKENIZER_PATTERNS
from tests.conftest import tiny_model

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
MAIN, V2 = "a" * 40, "b" * 40  # commit hashes


def add_snapshot(cache, repo_id: str, commit: str, source: str, refs=("main",)) -> str:
    """Copy `source`'s files into the hub cache's layout: models--org--name/snapshots/<commit>/,
    with refs/<ref> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return str(snapshot)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline. huggingface_hub reads its env vars when imported, so its
    constants are set too (a child process reads the env vars)."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache, char_llama):
    snapshot = add_snapshot(hub_cache, "org/tiny-llama", MAIN, char_llama)
    mc = EngineArgs(model="org/tiny-llama").create_config().model
    assert (mc.path, mc.format, mc.arch.architecture) == (snapshot, "hf", "llama")


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_picks_another_snapshot_by_branch_or_commit(hub_cache, revision):
    add_snapshot(hub_cache, "org/tiny", MAIN, tiny_model("llama"))
    other = add_snapshot(hub_cache, "org/tiny", V2, tiny_model("qwen3"), refs=("v2",))
    mc = EngineArgs(model="org/tiny", revision=revision).create_config().model
    assert (mc.path, mc.arch.architecture) == (other, "qwen3")
    assert EngineArgs(model="org/tiny").create_config().model.arch.architecture == "llama"


def test_download_dir_is_the_cache_folder(hub_cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    snapshot = add_snapshot(elsewhere, "tiny-llama", MAIN, tiny_model("llama"))  # a name without an org
    assert EngineArgs(model="tiny-llama", download_dir=str(elsewhere)).create_config().model.path == snapshot


def test_a_tokenizer_by_hub_id_honours_tokenizer_revision(hub_cache, char_llama):
    add_snapshot(hub_cache, "org/char-tokenizer", MAIN, tiny_model("llama"))
    tokenizer = add_snapshot(hub_cache, "org/char-tokenizer", V2, char_llama, refs=())
    mc = EngineArgs(model=tiny_model("llama"), tokenizer="org/char-tokenizer",
                    tokenizer_revision=V2).create_config().model
    assert mc.tokenizer == tokenizer


def test_a_repo_not_cached_while_offline_is_an_error_naming_it_and_hf_hub_offline(hub_cache):
    with pytest.raises(ValueError, match=r"model 'org/no-such-model' is neither a local path nor available "
                                         r"from the Hugging Face hub \(.*HF_HUB_OFFLINE"):
        EngineArgs(model="org/no-such-model").create_config()


def test_a_revision_not_cached_is_an_error_naming_it(hub_cache):
    add_snapshot(hub_cache, "org/tiny", MAIN, tiny_model("llama"))
    with pytest.raises(ValueError, match="model 'org/tiny' at revision 'v3' is neither a local path"):
        EngineArgs(model="org/tiny", revision="v3").create_config()


def test_a_hub_repo_without_config_json_is_a_clear_error(hub_cache, tmp_path):
    (tmp_path / "gguf-only").mkdir()
    (tmp_path / "gguf-only" / "model.gguf").write_bytes(b"")
    add_snapshot(hub_cache, "org/gguf-only", MAIN, tmp_path / "gguf-only")
    with pytest.raises(ValueError, match="hub model 'org/gguf-only' has no config.json"):
        EngineArgs(model="org/gguf-only").create_config()


def test_only_safetensors_configs_and_tokenizer_files_are_downloaded():
    from huggingface_hub.utils import filter_repo_objects
    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "vocab.json", "merges.txt", "chat_template.jinja", "special_tokens_map.json",
             "pytorch_model.bin", "model.pt", "weights.pth", "consolidated.safetensors",
             "original/consolidated.00.pth", "original/params.json", "onnx/model.onnx", "README.md", "model.gguf"]
    model = set(filter_repo_objects(files, allow_patterns=MODEL_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    assert model == {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                     "vocab.json", "merges.txt", "chat_template.jinja", "special_tokens_map.json"}
    tokenizer = set(filter_repo_objects(files, allow_patterns=TOKENIZER_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    assert tokenizer == model - {"model-00001-of-00002.safetensors"}


def test_jaxllm_generate_runs_a_model_by_hub_id_from_hf_home(tmp_path, char_llama):
    """The user's way: HF_HOME and HF_HUB_OFFLINE set before the process starts."""
    add_snapshot(tmp_path / "hf" / "hub", "org/tiny-llama", MAIN, char_llama)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "--model", "org/tiny-llama",
                             "--prompt", "abc", "--max-tokens", "4", "--ignore-eos", "--max-model-len", "64",
                             "--num-gpu-blocks-override", "16", "--max-num-seqs", "4", "--no-enable-multiprocessing"],
                            capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert "1 requests, 3 prompt + 4 generated tokens" in result.stdout, result.stdout


def test_a_repo_the_hub_does_not_have_is_an_error_with_the_hubs_message(monkeypatch):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def not_found(repo_id, **kwargs):
        url = f"https://huggingface.co/api/models/{repo_id}/revision/main"
        response = httpx.Response(404, request=httpx.Request("GET", url))
        raise RepositoryNotFoundError(f"404 Client Error. Repository Not Found for url: {url}.", response=response)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(ValueError, match=r"model 'org/no-such-model' is neither a local path nor available from the "
                                         r"Hugging Face hub \(RepositoryNotFoundError: 404 Client Error"):
        EngineArgs(model="org/no-such-model").create_config()


def test_tokenizer_revision_alone_takes_the_models_tokenizer_at_that_revision(hub_cache, char_llama):
    weights = add_snapshot(hub_cache, "org/tiny-llama", MAIN, tiny_model("llama"))
    tokenizer = add_snapshot(hub_cache, "org/tiny-llama", V2, char_llama, refs=("with-tokenizer",))
    mc = EngineArgs(model="org/tiny-llama", tokenizer_revision="with-tokenizer").create_config().model
    assert (mc.path, mc.tokenizer) == (weights, tokenizer)
