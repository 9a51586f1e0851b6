"""Which quantization a model runs with: EngineArgs.quantization (vLLM's names) and the
checkpoint's `quantization_config` (config.json), resolved into one QuantConfig.

    "fp8"                 a bf16 checkpoint quantized on load (models/fp8.py), or a checkpoint
                          of quant_method "fp8" (per-tensor scales, or `weight_block_size` blocks)
    "compressed-tensors"  llm-compressor's FP8: per-tensor, per-channel or block weight scales
    "awq", "gptq"         4-bit integer weights in groups (models/int4.py)

A Linear runs as one of three modules: Fp8Linear (a scale per output channel, which holds
per-tensor scales exactly), BlockFp8Linear, or Int4Linear. Every field a checkpoint may set
and we do not run raises a ValueError naming the field.
"""
import dataclasses
import re

from jaxllm.models.config import ModelArchConfig

QUANTIZATIONS = ("fp8", "compressed-tensors", "awq", "gptq")  # EngineArgs.quantization
FP8_CHANNEL, FP8_BLOCK, INT4 = "fp8_channel", "fp8_block", "int4"  # QuantConfig.scheme
# Linears the engine holds in the model's dtype whatever the checkpoint: MoE routers (a quantized router
# would pick other experts, as in vLLM) and latent attention's kv_b_proj (absorbed into the queries and
# outputs, read whole: models/deepseek.py). A checkpoint's quantized ones load dequantized.
MODEL_DTYPE_LINEARS = ("gate", "shared_expert_gate", "kv_b_proj")
INT4_GROUP_SIZES = (32, 64, 128)  # the W4A16 kernel's (kernels/w4a16.py): half a group is a dot >= 16 deep


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str  # one of QUANTIZATIONS
    scheme: str  # FP8_CHANNEL | FP8_BLOCK | INT4
    from_checkpoint: bool = True  # False: a bf16 checkpoint that "fp8" quantizes on load
    static_input_scale: bool = False  # FP8_CHANNEL: one calibrated input_scale per Linear; else per token
    block: tuple[int, int] | None = None  # FP8_BLOCK: [rows of out, columns of in] per weight scale
    group_size: int | None = None  # INT4: input rows per scale and zero point
    act_order: bool = False  # GPTQ's desc_act: rows come in g_idx order, permuted at load
    zero_offset: int = 0  # GPTQ's (v1 format) stored zero is the zero point minus 1
    ignore: tuple[str, ...] = ()  # modules kept in the checkpoint's dtype (see `quantizes`)

    @property
    def xla_fp8_dot(self) -> bool:
        """Whether the model's products are XLA dots of e4m3 operands (Fp8Linear), which the
        runner sends to cuBLASLt (worker/model_runner.py)."""
        return self.scheme == FP8_CHANNEL

    def whole_blocks(self, rows: int, cols: int) -> bool:
        """Whether a quantized weight [rows, cols] runs quantized: an FP8 block weight that is not whole
        blocks (DeepSeek-V3's kv_a_proj_with_mqa, 576 rows in blocks of 128: its last scale covers a
        partial block) loads dequantized instead (models/quant_checkpoint.py)."""
        return self.scheme != FP8_BLOCK or (rows % self.block[0] == 0 and cols % self.block[1] == 0)

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint quantizes the Linear of this HF module name (e.g.
        "model.layers.0.mlp.down_proj"). The LM head never is here. compressed-tensors' ignore
        entries are names or "re:" regexes; the others' are substrings (as transformers reads them)."""
        if module == "lm_head":
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif pattern == module or (self.method != "compressed-tensors" and pattern in module):
                return False
        return True

    def check_model(self, arch: ModelArchConfig, tensor_parallel_size: int) -> None:
        """Raise ValueError if the model's shapes, split over the devices, do not hold whole
        groups or blocks: a group or a block must not straddle two devices' shards."""
        tp = tensor_parallel_size
        if arch.mla is not None:
            return self._check_latent_model(arch, tp)
        q_dim = arch.num_heads * arch.head_dim
        # (what, a Linear's input rows on one device): qkv and gate_up read hidden_size, o_proj and
        # down_proj (row-parallel) their shard of the heads and of the intermediate
        inputs = [("hidden_size", arch.hidden_size), ("intermediate_size / tensor_parallel_size",
                  arch.intermediate_size // tp), ("num_heads * head_dim / tensor_parallel_size", q_dim // tp)]
        if self.scheme == INT4:
            for what, rows in inputs:
                _check(rows % self.group_size == 0, f"quantization_config.group_size {self.group_size} must divide {what} ({rows}): "
                       "a group must not straddle two devices' shards")
        if self.scheme == FP8_BLOCK:
            bn, bk = self.block
            for what, rows in inputs:
                _check(rows % bk == 0, f"the weight block's columns ({bk}) must divide {what} ({rows}): "
                       "a block must not straddle two devices' shards")
            for what, rows in (("head_dim", arch.head_dim), ("hidden_size", arch.hidden_size),
                               ("intermediate_size / tensor_parallel_size", arch.intermediate_size // tp)):
                _check(rows % bn == 0, f"the weight block's rows ({bn}) must divide {what} ({rows}): q, k and v "
                       "are fused per KV head, and a block must not straddle two devices' shards")

    def _check_latent_model(self, arch: ModelArchConfig, tp: int) -> None:
        """check_model for latent attention (DeepSeek), whose Linears are not fused per head: a split
        Linear that runs quantized (whole blocks) must split into whole blocks on each device (the
        experts and the Linears of partial blocks load dequantized)."""
        if self.scheme != FP8_BLOCK:  # (an int4 checkpoint of experts is refused with them: jaxllm/config.py)
            return
        mla, hidden = arch.mla, arch.hidden_size
        q_rows = arch.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        # (what, a split Linear's weight [rows, cols], the axis split over the devices: 0 rows, 1 columns)
        splits = [("the query projection's rows", (q_rows, mla.q_lora_rank or hidden), 0),
                  ("o_proj's columns", (hidden, arch.num_heads * mla.v_head_dim), 1)]
        for mlp, inter in (("dense MLPs'", arch.intermediate_size),
                           ("shared experts'", arch.moe.shared_expert_intermediate_size if arch.moe else 0)):
            if inter:
                splits += [(f"the {mlp} intermediate rows", (inter, hidden), 0),
                           (f"the {mlp} intermediate columns", (hidden, inter), 1)]
        for what, shape, axis in splits:
            size, block = shape[axis], self.block[axis]
            _check(not self.whole_blocks(*shape) or (size // tp) % block == 0,
                   f"{what} ({size}) split over tensor_parallel_size={tp} must be whole blocks of {block}: a block "
                   "must not straddle two devices' shards")


def resolve_quantization(requested: str | None, hf_config: dict, checkpoint_format: str) -> QuantConfig | None:
    """EngineArgs.quantization against the checkpoint's quantization_config (None: the checkpoint's)."""
    _check(requested in (None, *QUANTIZATIONS), f"quantization must be one of {QUANTIZATIONS} or None, "
           f"got {requested!r}")
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if qc is None:
        if requested is None:
            return None
        _check(requested == "fp8", f"quantization={requested!r} needs a checkpoint with a quantization_config "
               f"in its config.json; this {checkpoint_format} checkpoint has none")
        return QuantConfig("fp8", FP8_CHANNEL, from_checkpoint=False)
    _check(isinstance(qc, dict), f"config key 'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    _check(method in QUANTIZATIONS, f"quantization_config.quant_method {method!r} is not supported; "
           f"supported: {QUANTIZATIONS}")
    _check(requested in (None, method), f"quantization={requested!r} does not match the checkpoint's "
           f"quantization_config.quant_method {method!r}")
    return {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}[method](qc)


def _fp8(qc: dict) -> QuantConfig:
    """quant_method "fp8": e4m3 weights with per-tensor `weight_scale`s, or with `weight_scale_inv`
    blocks when weight_block_size is set (DeepSeek V3, Qwen3-FP8)."""
    _check(qc.get("fmt", "e4m3") == "e4m3", f"quantization_config.fmt must be 'e4m3', got {qc.get('fmt')!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    _check(scheme in ("dynamic", "static"), f"quantization_config.activation_scheme must be 'dynamic' or "
           f"'static', got {scheme!r}")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", FP8_CHANNEL, static_input_scale=scheme == "static", ignore=ignore)
    _check(scheme == "dynamic", "quantization_config.activation_scheme must be 'dynamic' with "
           "weight_block_size (activations are scaled per token and block as they come)")
    return QuantConfig("fp8", FP8_BLOCK, block=_block(block, "quantization_config.weight_block_size"), ignore=ignore)


def _block(block, field: str) -> tuple[int, int]:
    _check(isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 16 and not b & (b - 1)
                                                                 for b in block),
           f"{field} must be two powers of two >= 16 ([rows, columns]), got {block!r}")
    return tuple(block)


def _compressed_tensors(qc: dict) -> QuantConfig:
    """llm-compressor's FP8 checkpoints: one config group over the Linears, e4m3 weights
    ("float-quantized"), symmetric, per tensor, channel or block; activations dynamic per token
    (per token and block with block weights) or static per tensor."""
    fmt = qc.get("format")
    _check(fmt in ("float-quantized", "naive-quantized"), f"quantization_config.format {fmt!r} is not supported "
           "(compressed-tensors loads FP8 weights: 'float-quantized' or 'naive-quantized')")
    _check(not qc.get("kv_cache_scheme"), "quantization_config.kv_cache_scheme is not supported (the KV cache "
           "is quantized by kv_cache_dtype, with scale 1)")
    groups = qc.get("config_groups") or {}
    _check(isinstance(groups, dict) and len(groups) == 1, "quantization_config.config_groups must hold one group, "
           f"got {list(groups) if isinstance(groups, dict) else groups!r}")
    (name, group), = groups.items()
    field = f"quantization_config.config_groups.{name}"
    targets = group.get("targets")
    _check(targets == ["Linear"], f"{field}.targets must be ['Linear'], got {targets!r}")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True), ("dynamic", False)):
        _check(weights.get(key) == want, f"{field}.weights.{key} must be {want!r}, got {weights.get(key)!r}")
    strategy = weights.get("strategy")
    _check(strategy in ("tensor", "channel", "block"), f"{field}.weights.strategy must be 'tensor', 'channel' "
           f"or 'block', got {strategy!r}")
    _check(inputs is not None, f"{field}.input_activations is null: FP8 weights with 16-bit activations are not "
           "supported (the FP8 path quantizes activations too)")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        _check(inputs.get(key) == want, f"{field}.input_activations.{key} must be {want!r}, got {inputs.get(key)!r}")
    ignore = tuple(qc.get("ignore") or ())
    a_strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic")
    if strategy == "block":
        _check(dynamic is True and a_strategy == "group",
               f"{field}.input_activations must be dynamic per 'group' with block weights, got strategy "
               f"{a_strategy!r}, dynamic {dynamic!r}")
        block = _block(weights.get("block_structure"), f"{field}.weights.block_structure")
        _check(inputs.get("group_size") == block[1], f"{field}.input_activations.group_size must be the block's "
               f"columns ({block[1]}), got {inputs.get('group_size')!r}")
        return QuantConfig("compressed-tensors", FP8_BLOCK, block=block, ignore=ignore)
    _check((dynamic is True and a_strategy in ("token", "tensor")) or (dynamic is False and a_strategy == "tensor"),
           f"{field}.input_activations must be dynamic per 'token' or 'tensor', or static per 'tensor', got "
           f"strategy {a_strategy!r}, dynamic {dynamic!r}")
    return QuantConfig("compressed-tensors", FP8_CHANNEL, static_input_scale=dynamic is False, ignore=ignore)


def _int4_group(qc: dict, *keys: str) -> int:
    group = next((qc[k] for k in keys if k in qc), None)
    _check(group in INT4_GROUP_SIZES, f"quantization_config.{keys[0]} must be one of {INT4_GROUP_SIZES}, "
           f"got {group!r}")
    return group


def _awq(qc: dict) -> QuantConfig:
    """AutoAWQ's GEMM layout: 4 bits, zero points, groups of 32 to 128 input rows."""
    bits = qc.get("bits", qc.get("w_bit"))
    _check(bits == 4, f"quantization_config.bits must be 4, got {bits!r}")
    _check(qc.get("zero_point", True) is True, "quantization_config.zero_point must be true (symmetric AWQ "
           "is not supported)")
    version = str(qc.get("version", "gemm")).lower()
    _check(version == "gemm", f"quantization_config.version must be 'gemm' (AutoAWQ's GEMM layout), got {version!r}")
    return QuantConfig("awq", INT4, group_size=_int4_group(qc, "group_size", "q_group_size"),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict) -> QuantConfig:
    """AutoGPTQ / GPTQModel: 4 bits, symmetric or not, groups of 32 to 128 input rows, act-order."""
    _check(qc.get("bits") == 4, f"quantization_config.bits must be 4, got {qc.get('bits')!r}")
    fmt = qc.get("checkpoint_format", "gptq")
    _check(fmt in ("gptq", "gptq_v2"), f"quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2', "
           f"got {fmt!r}")
    _check(not qc.get("lm_head"), "quantization_config.lm_head must be false (a quantized LM head is not supported)")
    _check(not qc.get("dynamic"), "quantization_config.dynamic (per-module overrides) is not supported")
    return QuantConfig("gptq", INT4, group_size=_int4_group(qc, "group_size"), act_order=bool(qc.get("desc_act")),
                       zero_offset=1 if fmt == "gptq" else 0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def resolve_model_quantization(requested: str | None, hf_config: dict, fmt: str, arch: ModelArchConfig,
                               tp: int, path: str) -> QuantConfig | None:
    """EngineArgs.quantization against the checkpoint (resolve_quantization), checked against the
    model's shapes over tp devices; errors name the checkpoint's config.json."""
    try:
        quantization = resolve_quantization(requested, hf_config, fmt)
        if quantization is not None and quantization.from_checkpoint:
            _check(fmt == "hf", f"a quantized checkpoint loads from an HF folder, not a {fmt} checkpoint")
            quantization.check_model(arch, tp)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return quantization
