"""EngineArgs (the user's flags, vLLM's names) -> one validated Config."""
import dataclasses
import logging
import typing

from jaxllm.device_facts import DeviceFacts, device_facts
from jaxllm.dtypes import KV_CACHE_DTYPES, resolve_dtype
from jaxllm.lora.config import LoRAConfig, resolve_lora_config
from jaxllm.model_source import locate_model, resolve_model, resolve_tokenizer, tensor_names
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.eagle_config import EAGLE_TARGETS, EagleArchConfig
from jaxllm.models.kv_layout import model_kv_layout
from jaxllm.models.quant_config import INT4, QUANTIZATIONS, QuantConfig, resolve_model_quantization
from jaxllm.pooling_params import PoolerConfig
from jaxllm.sharding import layer_partition
from jaxllm.speculative_config import EAGLE_METHODS, SpeculativeConfig
from jaxllm.typecheck import check_field_types

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")  # core/scheduler.py


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str            # HF folder (a hub id's snapshot too), .gguf file, orbax folder, or bundled config name
    format: str          # "hf" | "gguf" | "orbax" | "bundled"
    hf_config: dict
    arch: ModelArchConfig
    dtype: object        # a jnp dtype
    max_model_len: int
    load_format: str     # "auto" | "dummy"
    skip_tokenizer_init: bool
    max_logprobs: int    # the most SamplingParams.logprobs a request may ask for
    tokenizer: str | None = None  # a tokenizer's HF folder or .gguf file; None: the model's own
    # EngineArgs.quantization resolved against the checkpoint's quantization_config (models/quant_config.py);
    # None: the dtype's
    quantization: QuantConfig | None = None
    pooler_config: PoolerConfig | None = None  # with runner="pooling"; None: the engine generates only


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    cache_dtype: type  # the KV cache's jnp dtype (EngineArgs.kv_cache_dtype resolved)
    enable_prefix_caching: bool = True  # reuse the KV blocks of a cached prefix (jaxllm/core/block_pool.py)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    async_scheduling: bool  # schedule step N+1 while step N runs on the device
    # Steps in flight, one per pipeline stage: a request waits for its sampled token before its next step
    pipeline_parallel_size: int = 1
    capacity_scheduler_policy: str = "max_utilization"  # EngineArgs'


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    data_parallel_size: int = 1      # engine cores, each in a process of its own (engine/dp_client.py)
    pipeline_parallel_size: int = 1  # stages of consecutive decoder layers, each on tp devices of its own
    layer_partition: tuple[int, ...] = ()  # with pipeline_parallel_size > 1: each stage's number of layers
    num_hosts: int = 1               # processes joined by jax.distributed into one mesh (executor/multihost.py)
    host_rank: int = 0
    coordinator_address: str | None = None
    device_ids: tuple[int, ...] | None = None  # the devices of a caller's mesh (LLM(mesh=...)); None: the first

    @property
    def devices_per_replica(self) -> int:
        """The devices one engine core (a data-parallel replica) runs on: its stages' tensor-parallel groups."""
        return self.pipeline_parallel_size * self.tensor_parallel_size


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    attention_backend: str
    seed: int
    logits_processors: tuple = ()  # LogitsProcessor subclasses (jaxllm/sample/logits_processor.py)
    batch_invariant: bool = False  # a request's numbers do not depend on its batch (kernels/batch_invariant.py)
    speculative: SpeculativeConfig | None = None  # speculative decoding (jaxllm/spec_decode)
    lora: LoRAConfig | None = None  # with enable_lora: per-request LoRA adapters (jaxllm/lora)
    enable_dbo: bool = False  # dual-batch overlap: each layer over one half of the tokens, then the other

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @property
    def drafts_on_device(self) -> bool:
        """The runner makes the drafts, on the device: a draft model's and an EAGLE head's always, n-gram
        drafts under asynchronous scheduling (the host makes them when it has each request's last token,
        as under pipeline parallelism, whose steps never read a token still on the device)."""
        spec = self.speculative
        return spec is not None and (spec.method != "ngram" or (self.scheduler.async_scheduling
                                                                and self.parallel.pipeline_parallel_size == 1))


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    # None: 256 sequences and 8192 batched tokens on a GPU (the H200's best for most workloads,
    # docs/benchmarks.md), 64 and min(2048, max(max_model_len, max_num_seqs)) on CPU
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    load_format: str = "auto"
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # vLLM's: a mixture-of-experts model's experts whole on each of the tensor-parallel devices (E / tp
    # each), tokens sent to them and back by all-to-all; off: every expert split over the devices as a
    # dense MLP is (models/moe.py). The attention stays tensor parallel either way.
    enable_expert_parallel: bool = False
    # "uni": this process drives its local devices through one mesh; "multihost": num_hosts processes,
    # one per host, joined by jax.distributed at coordinator_address ("host:port"), one mesh over all
    # their devices; host_rank 0 serves, the others run `jaxllm worker` (executor/multihost.py);
    # "ray": each data-parallel replica in a Ray actor, anywhere in the cluster (engine/ray_dp.py).
    distributed_executor_backend: str = "uni"
    num_hosts: int = 1
    host_rank: int = 0
    coordinator_address: str | None = None
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None  # vLLM's: another tokenizer than the model's (an HF folder, a .gguf file or a hub id)
    # A hub id's branch, tag or commit (None: main), and its cache folder (None: the hub's, $HF_HUB_CACHE).
    revision: str | None = None
    tokenizer_revision: str | None = None  # of the tokenizer's hub id (tokenizer, else model); None: main
    download_dir: str | None = None
    max_logprobs: int = 20  # vLLM's default; each step that returns logprobs computes this many
    # vLLM's: "fp8" (a bf16 checkpoint's Linears quantized to e4m3 on load, or an FP8 checkpoint),
    # "compressed-tensors", "awq", "gptq"; None: what the checkpoint's quantization_config says
    quantization: str | None = None
    # vLLM's: "auto" (the model's dtype), "bfloat16", "fp8" (= "fp8_e4m3") or "fp8_e5m2": K and V in 8 bits
    # (kernels/reference.py write_kv), read back in the attention kernels; twice the tokens per GB
    kv_cache_dtype: str = "auto"
    # None: on. With speculative decoding the drafts are then made on the device (n-gram ones too); off, n-gram
    # drafts are made on the host, one step at a time
    async_scheduling: bool | None = None
    # Users' LogitsProcessor classes, or their "module:Class" names (jaxllm/sample/logits_processor.py)
    logits_processors: list[type | str] | None = None
    # The engine core in its own process (EngineCoreProc); None reads $JAXLLM_ENABLE_MULTIPROCESSING (on unless "0").
    enable_multiprocessing: bool | None = None
    # A request's tokens and logprobs bitwise the same whatever else is in its batch: every matmul,
    # norm and attention reduction in one order for every batch (kernels/batch_invariant.py). Slower.
    batch_invariant: bool = False
    # vLLM's: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": .., "prompt_lookup_max": ..}
    # or {"method": "draft_model", "model": <a smaller model with the same tokenizer>, "num_speculative_tokens": k}
    # or {"method": "eagle" | "eagle3", "model": <an EAGLE head's HF folder>, "num_speculative_tokens": k}
    speculative_config: dict[str, typing.Any] | None = None
    # vLLM's: "pooling" also serves embeddings (LLM.embed, LLM.score, /v1/embeddings, /score), and unlike
    # vLLM's still generates; "auto" and "generate": generation only (every architecture here is a decoder)
    runner: str = "auto"
    # vLLM's, with runner="pooling": {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} (LAST, true)
    pooler_config: dict[str, typing.Any] | None = None
    # vLLM's: requests may name a PEFT LoRA adapter (LoRARequest), max_loras of them on the device at once
    # (and in one step), each padded to max_lora_rank; max_cpu_loras read ones kept in host memory
    # (None: max_loras). See docs/lora.md.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Which waiting requests the scheduler admits while KV blocks are free (core/scheduler.py), named as
    # TensorRT-LLM's: "max_utilization" (vLLM's: any that fits now; a running request is preempted when
    # blocks run out) or "guaranteed_no_evict" (one only if the blocks every running request and it
    # need to reach max_tokens are free: no preemption, and as many requests as the cache holds whole)
    capacity_scheduler_policy: str = "max_utilization"
    # vLLM's dual-batch overlap: every layer on one half of a step's tokens, then the other, so one half's
    # collectives (all-reduces, all-to-alls) may overlap the other's compute (models/dual_batch.py)
    enable_dbo: bool = False

    def create_config(self, devices: DeviceFacts | None = None) -> Config:
        """The validated Config, for the devices `devices` describes (default: those a fresh process
        of this environment sees, found without starting a JAX backend here: jaxllm/device_facts.py).
        A hub id is downloaded here."""
        check_field_types(self)
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1, got {self.max_model_len}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.block_size in (16, 32, 64, 128), f"block_size must be 16, 32, 64 or 128, got {self.block_size}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
               f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        _check(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        _check(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        _check(self.quantization in (None, *QUANTIZATIONS),
               f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _check(self.capacity_scheduler_policy in CAPACITY_POLICIES,
               f"capacity_scheduler_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_scheduler_policy!r}")
        _check(self.load_format in ("auto", "dummy"), f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _check(not self.batch_invariant or self.quantization is None,
               "batch_invariant runs without quantization (quantized GEMMs have no batch-invariant kernel), "
               f"got quantization={self.quantization!r}")
        _check(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _check(self.data_parallel_size >= 1, f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        _check(self.pipeline_parallel_size >= 1, f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        _check(self.distributed_executor_backend in ("uni", "multihost", "ray"),
               "distributed_executor_backend must be 'uni', 'multihost' or 'ray', "
               f"got {self.distributed_executor_backend!r}")
        _check(self.num_hosts >= 1, f"num_hosts must be >= 1, got {self.num_hosts}")
        _check((self.num_hosts > 1) == (self.distributed_executor_backend == "multihost"),
               f"num_hosts ({self.num_hosts}) > 1 goes with distributed_executor_backend='multihost' "
               f"(got {self.distributed_executor_backend!r})")
        _check(0 <= self.host_rank < self.num_hosts,
               f"host_rank must be in [0, num_hosts={self.num_hosts}), got {self.host_rank}")
        _check(self.num_hosts == 1 or (self.coordinator_address or "").rpartition(":")[2].isdigit(),
               f"coordinator_address must be 'host:port' with num_hosts > 1, got {self.coordinator_address!r}")
        _check(self.num_hosts == 1 or self.data_parallel_size == 1,
               "data_parallel_size > 1 over several hosts is not built: use num_hosts with tensor parallelism")
        speculative = None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        pooler_config = self._pooler_config(speculative)
        devices = devices or device_facts()
        num_devices = devices.local_device_count * self.num_hosts
        pp = "" if self.pipeline_parallel_size == 1 else f"pipeline_parallel_size={self.pipeline_parallel_size} x "
        _check(self.tensor_parallel_size * self.pipeline_parallel_size <= num_devices,
               f"{pp}tensor_parallel_size={self.tensor_parallel_size} exceeds the {num_devices} visible device(s)")
        from jaxllm.kernels.attention import BACKENDS
        _check(self.attention_backend in (None, *BACKENDS),
               f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")

        # As in vLLM, tokenizer_revision alone asks for the model's own tokenizer at that revision.
        tokenizer = self.model if self.tokenizer is None and self.tokenizer_revision is not None else self.tokenizer
        tokenizer = resolve_tokenizer(tokenizer, self.tokenizer_revision, self.download_dir)
        from jaxllm.sample.logits_processor import resolve_logits_processors
        logits_processors = resolve_logits_processors(self.logits_processors)
        _check(speculative is None or not logits_processors,
               "speculative_config does not run with logits_processors yet (their state is one row per request)")
        path, fmt, hf_config, arch = resolve_model(self.model, self.load_format, self.revision, self.download_dir)
        tp = self.tensor_parallel_size
        quantization = resolve_model_quantization(self.quantization, hf_config, fmt, arch, tp, path)
        _check(not self.batch_invariant or quantization is None, "batch_invariant runs without quantization, "
               f"and the checkpoint is quantized ({quantization and quantization.method!r})")
        # KV heads fewer than the devices are replicated (worker/kv_heads.py): TP must divide the q
        # heads, and the KV heads must divide TP or TP them.
        attention = arch.mamba is None or len(arch.mamba.layers) < arch.num_layers
        heads_split = arch.num_heads % tp == 0 and (arch.num_kv_heads % tp == 0 or tp % arch.num_kv_heads == 0)
        _check(heads_split or not attention,
               f"tensor_parallel_size={tp} must divide the model's attention heads ({arch.num_heads}), "
               f"and divide or be a multiple of its KV heads ({arch.num_kv_heads})")
        dense_mlp = arch.moe is None or len(arch.moe.sparse_layers) < arch.num_layers
        _check(not dense_mlp or arch.intermediate_size % tp == 0, f"tensor_parallel_size={tp} must divide the "
               f"model's intermediate_size ({arch.intermediate_size}): each device holds a slice of every MLP")
        _check(arch.vocab_size % tp == 0, f"tensor_parallel_size={tp} must divide the model's vocab_size "
               f"({arch.vocab_size}): each device holds a slice of the embedding's and the LM head's rows")
        backend = self._attention_backend(arch, speculative, devices)
        arch = self._check_experts(arch, quantization)
        prefix_caching = self._check_mamba(arch, speculative, quantization)
        partition = self._layer_partition(arch, speculative, quantization)
        for ok, what in ((speculative is None, "speculative_config"), (arch.mamba is None, "a Mamba model"),
                         (not self.enable_lora, "enable_lora")):
            _check(not self.enable_dbo or ok, f"enable_dbo does not run with {what} yet")
        max_len = arch.max_position_embeddings if self.max_model_len is None else self.max_model_len
        # A Mamba2 model has no positions: its config's length is only the default.
        _check(arch.mamba is not None or max_len <= arch.max_position_embeddings,
               f"max_model_len must be in [1, {arch.max_position_embeddings}] (the model's "
               f"max_position_embeddings), got {max_len}")
        dtype = resolve_dtype(self.dtype, hf_config, platform=devices.platform)
        on_gpu = devices.platform == "gpu"
        max_num_seqs = self.max_num_seqs or (256 if on_gpu else 64)
        batched = self.max_num_batched_tokens or (8192 if on_gpu else min(2048, max(max_len, max_num_seqs)))
        _check(batched >= max_num_seqs,
               f"max_num_batched_tokens ({batched}) must be >= max_num_seqs ({max_num_seqs})")
        if speculative is not None and speculative.method == "draft_model":
            speculative = dataclasses.replace(speculative, draft=self._draft_model(speculative.model, arch, max_len,
                                                                                   devices.platform))
        elif speculative is not None and speculative.method in EAGLE_METHODS:
            speculative = dataclasses.replace(speculative, draft=self._eagle_head(speculative.method, speculative.model,
                                                                                  arch, max_len, dtype))
        lora = resolve_lora_config(self.enable_lora, self.max_loras, self.max_lora_rank, self.max_cpu_loras, arch, {
            "speculative_config": speculative is not None, "runner='pooling'": pooler_config is not None,
            "batch_invariant": self.batch_invariant})
        return Config(
            model=ModelConfig(path=path, format=fmt, hf_config=hf_config, arch=arch,
                              dtype=dtype, max_model_len=max_len,
                              load_format=self.load_format, skip_tokenizer_init=self.skip_tokenizer_init,
                              max_logprobs=self.max_logprobs, tokenizer=tokenizer, quantization=quantization,
                              pooler_config=pooler_config),
            cache=CacheConfig(self.block_size, self.gpu_memory_utilization, self.num_gpu_blocks_override,
                              KV_CACHE_DTYPES[self.kv_cache_dtype] or dtype, prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, batched, max_len,
                                      self.async_scheduling is not False,
                                      self.pipeline_parallel_size, self.capacity_scheduler_policy),
            parallel=ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, self.pipeline_parallel_size,
                                    partition, self.num_hosts, self.host_rank, self.coordinator_address),
            attention_backend=backend,
            seed=self.seed,
            logits_processors=logits_processors,
            batch_invariant=self.batch_invariant,
            speculative=speculative,
            lora=lora,
            enable_dbo=self.enable_dbo,
        )

    def _pooler_config(self, speculative: SpeculativeConfig | None) -> PoolerConfig | None:
        _check(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.runner != "pooling":
            _check(self.pooler_config is None, f"pooler_config is for runner='pooling', got runner={self.runner!r}")
            return None
        _check(speculative is None, "runner='pooling' does not run with speculative_config yet (a drafter's KV "
               "after a pooling request's last token would read a token that never comes)")
        return PoolerConfig.from_dict(self.pooler_config or {})

    def _attention_backend(self, arch: ModelArchConfig, speculative, devices: DeviceFacts) -> str:
        """The one asked for, else the platform's fastest. Latent attention (DeepSeek, models/deepseek.py) runs
        on its own backends (kernels/attention.py, LATENT_BACKENDS: the Pallas latent kernel on a GPU, the
        reference elsewhere), and without what it does not take yet."""
        if arch.mla is None:
            return self.attention_backend or devices.attention_backend
        from jaxllm.kernels.attention import LATENT_BACKENDS
        name = arch.architecture
        _check(self.attention_backend in (None, *LATENT_BACKENDS), f"attention_backend={self.attention_backend!r} "
               f"has no latent-attention kernel: the {name} model runs on one of {LATENT_BACKENDS}")
        _check(speculative is None or speculative.method == "ngram", f"speculative_config.method "
               f"{speculative and speculative.method!r} does not run with the {name} model yet: use 'ngram'")
        return self.attention_backend or ("pallas" if devices.platform == "gpu" else "reference")

    def _check_experts(self, arch: ModelArchConfig, quantization: QuantConfig | None) -> ModelArchConfig:
        """A mixture-of-experts model's experts checked against the devices, with enable_expert_parallel
        in its MoeConfig (whole experts per device); a dense model takes no enable_expert_parallel."""
        tp, moe = self.tensor_parallel_size, arch.moe
        if moe is None:
            _check(not self.enable_expert_parallel, "enable_expert_parallel is for mixture-of-experts models "
                   "(Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2 and V3, Granite 4.0-H with experts); this "
                   f"{arch.architecture} model has none")
            return arch
        _check(quantization is None or quantization.scheme != INT4,
               f"a {quantization and quantization.method} {arch.architecture} checkpoint does not load yet (its "
               "experts are not Linears): load an FP8 or bf16 checkpoint")
        _check(not self.batch_invariant, "batch_invariant does not run mixture-of-experts models (the experts' "
               "grouped GEMM has no batch-invariant kernel)")
        if self.enable_expert_parallel:
            _check(moe.num_experts % tp == 0, f"enable_expert_parallel: tensor_parallel_size={tp} must divide the "
                   f"model's experts ({moe.num_experts})")
            return dataclasses.replace(arch, moe=dataclasses.replace(moe, expert_parallel=True))
        _check(moe.intermediate_size % tp == 0, f"tensor_parallel_size={tp} must divide each expert's intermediate "
               f"size ({moe.intermediate_size}), or enable_expert_parallel put whole experts on each device")
        return arch

    def _check_mamba(self, arch: ModelArchConfig, speculative: SpeculativeConfig | None,
                     quantization: QuantConfig | None) -> bool:
        """What a Mamba2 model does not run with yet; returns enable_prefix_caching, off for it (a
        request's state slot holds its whole prefix, not blocks another request can share)."""
        if arch.mamba is None:
            return self.enable_prefix_caching
        tp = self.tensor_parallel_size
        _check(arch.mamba.num_heads % tp == 0, f"tensor_parallel_size={tp} must divide the model's Mamba heads "
               f"({arch.mamba.num_heads}): each device runs whole heads")
        checkpoint = quantization is not None and quantization.from_checkpoint
        for ok, what in ((speculative is None, "speculative_config"),
                         (not checkpoint, f"a quantized checkpoint ({quantization and quantization.method})"),
                         (not self.batch_invariant, "batch_invariant")):
            _check(ok, f"a {arch.architecture} model does not run with {what} yet")
        if self.enable_prefix_caching:
            logger.info("prefix caching is off for the %s model: its state slots hold whole prefixes, "
                        "not blocks to share", arch.architecture)
        return False

    def _layer_partition(self, arch: ModelArchConfig, speculative: SpeculativeConfig | None,
                         quantization: QuantConfig | None) -> tuple[int, ...]:
        """With pipeline_parallel_size > 1, each stage's number of decoder layers (sharding.layer_partition),
        checked against what pipeline parallelism runs with."""
        pp = self.pipeline_parallel_size
        if pp == 1:
            return ()
        for ok, what in ((speculative is None or speculative.method == "ngram",
                          f"speculative_config method {speculative and speculative.method!r} (n-gram runs)"),
                         (not self.enable_lora, "enable_lora")):
            _check(ok, f"pipeline_parallel_size={pp} does not run with {what} yet")
        return layer_partition(arch.num_layers, pp)

    def _draft_model(self, model: str, target: ModelArchConfig, max_len: int, platform: str) -> ModelConfig:
        """speculative_config.model resolved as the draft of `target`: its tokens must be the
        target's, its context as long, its heads as divisible, and its attention no wider than
        the target's first KV cache group (whose block tables it reads: models/kv_layout.py)."""
        try:
            path, fmt, hf_config, arch = resolve_model(model, self.load_format, None, self.download_dir)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        _check(arch.vocab_size == target.vocab_size,
               f"speculative_config.model: the draft's vocabulary has {arch.vocab_size} tokens and the target's "
               f"{target.vocab_size}: a draft model shares the target's tokenizer")
        _check(arch.max_position_embeddings >= max_len,
               f"speculative_config.model: the draft's max_position_embeddings ({arch.max_position_embeddings}) "
               f"is shorter than max_model_len ({max_len})")
        self._check_draft_attention("draft", arch, target)
        try:
            quantization = resolve_model_quantization(None, hf_config, fmt, arch, self.tensor_parallel_size, path)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        return ModelConfig(path=path, format=fmt, hf_config=hf_config, arch=arch,
                           dtype=resolve_dtype(self.dtype, hf_config, platform=platform), max_model_len=max_len,
                           load_format=self.load_format, skip_tokenizer_init=True, max_logprobs=0,
                           quantization=quantization)

    def _eagle_head(self, method: str, model: str, target: ModelArchConfig, max_len: int, dtype) -> ModelConfig:
        """speculative_config.model resolved as an EAGLE head of `target` (models/eagle.py): an HF
        folder whose config and tensors fit the target's hidden states, vocabulary and layers. It
        runs in the target's dtype, at any position (RoPE does not end at its max_position_embeddings)."""
        _check(target.architecture in EAGLE_TARGETS, f"speculative_config.method {method!r} runs on the "
               f"Llama-family targets {EAGLE_TARGETS}, not on {target.architecture!r}")
        try:
            path, fmt, hf_config, _ = locate_model(model, self.load_format, None, self.download_dir)
            _check(fmt == "hf", f"an EAGLE head is an HF folder (config.json and safetensors), got {path!r}")
            names = None if self.load_format == "dummy" else tensor_names(path)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        try:
            arch = EagleArchConfig.of_head(hf_config, method, target, names)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {path}: {e}") from e
        self._check_draft_attention("head", arch, target)
        return ModelConfig(path=path, format=fmt, hf_config=hf_config, arch=arch, dtype=dtype, max_model_len=max_len,
                           load_format=self.load_format, skip_tokenizer_init=True, max_logprobs=0)

    def _check_draft_attention(self, what: str, arch: ModelArchConfig, target: ModelArchConfig) -> None:
        """A draft model's or head's attention splits over the devices, and reaches no further back than
        the target's first KV cache group (whose block tables it reads: models/kv_layout.py)."""
        tp = self.tensor_parallel_size
        _check(arch.num_heads % tp == 0 and (arch.num_kv_heads % tp == 0 or tp % arch.num_kv_heads == 0),
               f"speculative_config.model: tensor_parallel_size={tp} must divide the {what}'s attention heads "
               f"({arch.num_heads}), and divide or be a multiple of its KV heads ({arch.num_kv_heads})")
        window = model_kv_layout(target).groups[0].sliding_window
        windows = [arch.layer_sliding_window(i) for i in range(arch.num_layers)]
        _check(window is None or all(w is not None and w <= window for w in windows),
               f"speculative_config.model: the {what} attends beyond the target's sliding window ({window})")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
