"""The model names a server answers to: the base model's (--served-model-name) and one per LoRA
adapter (--lora-modules, and at run time /v1/load_lora_adapter and /v1/unload_lora_adapter when
$JAXLLM_ALLOW_RUNTIME_LORA_UPDATING or vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true). A request
whose `model` is an adapter's name runs on that adapter; an unknown name is a 404."""
import itertools
import os

from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from jaxllm.lora.request import LoRARequest

RUNTIME_LORA_UPDATING_ENV = ("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating() -> bool:
    """Whether the load and unload endpoints are served (off unless one of the variables is "1" or "true")."""
    return any(os.environ.get(name, "").lower() in ("1", "true") for name in RUNTIME_LORA_UPDATING_ENV)


class ServingModels:
    def __init__(self, engine, base_names: list[str], lora_modules: list[tuple[str, str]] = ()):
        """lora_modules: (name, path) of the adapters served from the start, checked here (ValueError)."""
        self.engine, self.base_names = engine, base_names
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for name, path in lora_modules:
            self._check_new_name(name, ValueError)
            lora_request = LoRARequest(name, next(self._ids), path)
            engine.lora_checks.check(lora_request)
            self.loras[name] = lora_request

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); an unknown name is a 404."""
        if name is None or name in self.base_names:
            return None
        if name in self.loras:
            return self.loras[name]
        raise APIError(404, f"The model {name[:200]!r} does not exist.", param="model", code="model_not_found")

    def cards(self) -> list[ModelCard]:
        model = self.engine.config.model
        cards = [ModelCard(id=name, root=model.path, max_model_len=model.max_model_len) for name in self.base_names]
        return cards + [ModelCard(id=name, root=lora.lora_path, parent=self.base_names[0],
                                  max_model_len=model.max_model_len) for name, lora in self.loras.items()]

    def _check_new_name(self, name: str, error=None) -> None:
        if name in self.base_names or name in self.loras:
            what = "the base model's name" if name in self.base_names else "an adapter already loaded"
            message = f"The lora adapter {name!r} has already been loaded ({what})."
            raise error(message) if error else APIError(400, message, param="lora_name")

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """Check the adapter's files (a 400 naming the file and field) and read it into the engine."""
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        self._check_new_name(body.lora_name)
        lora_request = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
        try:
            await self.engine.add_lora(lora_request)
        except (ValueError, TypeError) as e:
            raise APIError(400, " ".join(str(e).splitlines()), param="lora_path") from e
        self._check_new_name(body.lora_name)  # again: another load of the name may have finished meanwhile
        self.loras[body.lora_name] = lora_request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter's name; requests already running on it finish on it."""
        lora_request = self.loras.pop(body.lora_name, None)
        if lora_request is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        await self.engine.remove_lora(lora_request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
