"""Multi-LoRA serving: per-request PEFT adapters over one base model (docs/lora.md)."""
from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
