"""LLM: offline batch inference, vLLM's class and method names."""
import collections
import dataclasses
import logging
import time
from collections.abc import Sequence

from tqdm import tqdm

from jaxllm.config import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.processor import PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

Messages = list[dict]
logger = logging.getLogger(__name__)


class LLM:
    """An engine for offline generation.

    LLM(model=None) runs the embedded SmolLM2-135M-Instruct; `model` may be an HF
    folder, a .gguf file, or (with load_format="dummy") a bundled config name.
    Every other keyword is an EngineArgs field (max_model_len, max_num_seqs, ...).

    The engine core runs in a process of its own (enable_multiprocessing=False keeps it
    in this one). `shutdown()`, leaving a `with LLM(...) as llm:` block, `del llm` and
    interpreter exit all stop it and free its device memory.
    """

    def __init__(self, model: str | None = None, **kwargs):
        show_progress = kwargs.pop("show_progress", True)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs), show_progress)
        self._counter = 0

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        return self._run(list(prompts), params, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine was started with skip_tokenizer_init")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
                raise ValueError(f"conversation {i}: every message needs 'role' and 'content'")
            text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, each asking only for the final output."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        final = {}  # copy each distinct object once; the caller's stays as it was
        for p in sampling_params:
            if id(p) not in final:
                final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        return [final[id(p)] for p in sampling_params]

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(self._counter)
                self._counter += 1
                try:
                    engine.add_request(request_id, prompt, p)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise

        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += len(out.outputs[0].token_ids)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, output: {out_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()
        failed = collections.Counter(o.error for o in finished.values() if o.outputs[0].finish_reason == "error")
        for error, count in failed.items():
            logger.warning("%d of %d requests failed: %s", count, len(ids), error)
        return [finished[i] for i in ids]
