"""LoRARequest: which adapter a request runs on (vLLM's class and fields)."""
import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """A PEFT LoRA adapter for one request: `lora_name` names it (in the server, its model name),
    `lora_int_id` (>= 1) identifies it in the engine (two requests with the same id share the
    adapter's device slot, so one id is one adapter), `lora_path` is its folder
    (adapter_config.json and adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's folder, got {self.lora_path!r}")


def lora_request_fields(lora_request: LoRARequest) -> tuple[str, int, str]:
    """(name, id, path): what a utility call to the engine core carries (its arguments are plain data)."""
    return lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path
