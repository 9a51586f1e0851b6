"""LLMEngine: a thin shell over the engine core: prompts in, RequestOutputs out."""
import itertools

from jaxllm.config import Config, EngineArgs
from jaxllm.engine.core import EngineCore, InprocClient
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.processor import Processor, PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer import generation_eos_ids, get_tokenizer


class LLMEngine:
    def __init__(self, config: Config, show_progress: bool = True):
        self.config = config
        self.tokenizer = get_tokenizer(config.model)
        self.eos_token_ids = generation_eos_ids(config.model, self.tokenizer)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = InprocClient(EngineCore(config, show_progress))
        self._request_counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = True) -> "LLMEngine":
        return cls(args.create_config(), show_progress)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Validate and queue one request; a bad one raises ValueError and leaves the rest untouched."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.processor.process(prompt, params)
        n = next(self._request_counter)
        # Without a seed of its own, a request draws from the engine seed and its arrival number.
        seed = params.seed if params.seed is not None else hash((self.config.seed, n)) & (2**63 - 1)
        request = Request(request_id, token_ids, params, self.eos_token_ids, seed)
        self.output_processor.add_request(request_id, text, token_ids, params)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self.output_processor.abort(request_ids)

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process_outputs(self.engine_core.get_output())
        if stopped:
            self.engine_core.abort_requests(stopped)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()
