"""LoRAConfig: EngineArgs' LoRA fields (vLLM's names) resolved and checked against the model."""
import dataclasses

from jaxllm.models.config import ModelArchConfig

# The architectures whose decoder is models/llama.py's Attention and MLP, which apply the adapters.
LORA_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1        # adapters on the device at once: the most distinct adapters in one step
    max_lora_rank: int = 16   # every slot's rank: an adapter of lower rank is padded with zeros
    max_cpu_loras: int = 1    # adapters kept read in host memory (>= max_loras), the least recently used dropped


def resolve_lora_config(enable_lora: bool, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                        arch: ModelArchConfig, what_else: dict[str, bool]) -> LoRAConfig | None:
    """None unless enable_lora. what_else: the engine's other features LoRA does not run with yet
    (name -> whether it is on); each raises ValueError naming it."""
    if not enable_lora:
        return None
    if type(max_loras) is not int or max_loras < 1:
        raise ValueError(f"max_loras must be an int >= 1, got {max_loras!r}")
    if type(max_lora_rank) is not int or max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be an int >= 1, got {max_lora_rank!r}")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if type(cpu) is not int or cpu < max_loras:
        raise ValueError(f"max_cpu_loras must be an int >= max_loras ({max_loras}), got {max_cpu_loras!r}")
    if arch.architecture not in LORA_ARCHITECTURES or arch.moe is not None:
        raise ValueError(f"enable_lora runs the Llama-family models {LORA_ARCHITECTURES} (dense), "
                         f"not {arch.architecture!r}")
    for name, on in what_else.items():
        if on:
            raise ValueError(f"enable_lora does not run with {name} yet")
    return LoRAConfig(max_loras, max_lora_rank, cpu)
