"""LLM: offline batch inference, vLLM's class and method names (generate, chat, and on an engine
started with runner="pooling" embed and score)."""
import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

from tqdm import tqdm

from jaxllm.config import EngineArgs
from jaxllm.engine.exceptions import EngineDeadError
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.processor import PromptType
from jaxllm.entrypoints.chat_utils import chat_messages
from jaxllm.entrypoints.score_utils import check_score_inputs, cosine_scores
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringRequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

Messages = list[dict]
logger = logging.getLogger(__name__)


class LLM:
    """An engine for offline generation, and with runner="pooling" for embeddings (embed, score).

    LLM(model=None) runs the embedded SmolLM2-135M-Instruct; `model` may be an HF
    folder, a .gguf file, or (with load_format="dummy") a bundled config name.
    Every other keyword is an EngineArgs field (max_model_len, max_num_seqs, ...).

    The engine core runs in a process of its own (enable_multiprocessing=False keeps it
    in this one). `shutdown()`, leaving a `with LLM(...) as llm:` block, `del llm` and
    interpreter exit all stop it and free its device memory.

    Several threads may call generate and chat at once: their requests share the
    engine's batches, and each call returns its own outputs.
    """

    def __init__(self, model: str | None = None, params=None, mesh=None, **kwargs):
        """params: the model's params in memory (the engine's layout, or HF names to arrays:
        docs/jax.md), instead of reading `model`'s weights; `model` still names the architecture
        and the tokenizer. mesh: a jax.sharding.Mesh whose devices the engine runs on,
        tensor-parallel over all of them. Either runs the engine core in this process."""
        show_progress = kwargs.pop("show_progress", True)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs), show_progress, params, mesh)
        self._counter = 0
        # One caller at a time adds requests or runs a step. Whichever caller runs the step,
        # each finished output goes to the inbox of the call that owns the request.
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.SimpleQueue] = {}
        self._paused = self._asleep = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no sampling_params: the model's recommended
        temperature, top_p, top_k, min_p and max_tokens (its generation_config.json, or a GGUF
        file's general.sampling.* keys) over SamplingParams' defaults, as vLLM does."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after new weights, or to time without the cache).
        Returns False, forgetting nothing, while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self, log_dir: str | None = None) -> None:
        """Trace the engine core with jax.profiler into `log_dir` (default $JAXLLM_PROFILER_DIR)
        until stop_profile(); open it in TensorBoard or XProf, or read it with jaxllm.profiling."""
        self.llm_engine.start_profile(log_dir)

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    # ---- inside a JAX program (docs/jax.md) ----
    def get_params(self) -> dict:
        """The model's params in the engine's layout: a nested dict of the engine's own arrays
        (read them; do not donate or delete them)."""
        return self.llm_engine.get_params()

    def get_logprobs_fn(self):
        """fn(params, token_ids [S] int32) -> [S - 1] float32: log p(token_ids[i + 1] | token_ids[:i + 1])
        from one plain forward of the whole sequence, a pure function of params (jax.grad it); with
        batch_invariant=True bitwise the logprobs the engine gives the same tokens."""
        return self.llm_engine.get_logprobs_fn()

    def update_weights(self, source) -> None:
        """New weights without a restart or a recompilation: params in memory (either layout of
        get_params / HF names; placed device to device, the old ones freed as the new come) or a
        checkpoint's path. The prefix cache is forgotten. Raises ValueError while a generate call
        runs, unless generation is paused."""
        with self._lock:
            self.llm_engine.update_weights(source)

    def pause_generation(self, mode: str = "wait") -> None:
        """Stop generating until resume_generation. "wait": requests already in the engine run to
        their end first (this call drives them); "abort": they end now with finish_reason "abort";
        "keep": they stay, their KV freed, and go on after resume (under new weights, if any).
        generate raises while paused."""
        with self._lock:
            self.llm_engine.pause_generation(mode)
            self._paused = True
        # Drive the engine until the pause has done its work: the aborted requests' last outputs
        # handed to their callers, or the running requests finished.
        while (self.llm_engine.has_unfinished_requests() if mode == "abort" else
               mode == "wait" and self.llm_engine.get_stats()["num_running"]):
            with self._lock:
                self._step()

    def resume_generation(self) -> None:
        with self._lock:
            self.llm_engine.resume_generation()
            self._paused = False

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and the prefix cache (level 1), and the weights too (level 2), between
        rollouts; wake_up makes them again. The compiled steps stay: nothing compiles on waking."""
        with self._lock:
            self.llm_engine.sleep(level)
            self._asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Make again what sleep freed: "weights" (from the checkpoint; weights given in memory come
        back through update_weights) and "kv_cache"; default both."""
        with self._lock:
            self.llm_engine.wake_up(tags)
            self._asleep = self.llm_engine.is_sleeping()

    def is_sleeping(self) -> bool:
        return self._asleep

    def collective_rpc(self, method: str, args: tuple = ()):
        """Call a method of the model runner (vLLM's collective_rpc); its result."""
        with self._lock:
            return self.llm_engine.collective_rpc(method, args)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order. A bad
        prompt raises ValueError or TypeError naming its index ("prompt 2: ...") and
        leaves none of this call's requests in the engine. Without sampling_params, the
        model's defaults (get_default_sampling_params). lora_request: the LoRA adapter every
        prompt runs on, or one per prompt (None: the base model); the engine needs enable_lora.

        A request the engine failed (a model step that raised) comes back with
        finish_reason "error" and its `error` set, and a warning is logged."""
        prompts = _prompt_list(prompts, "prompts")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, _lora_list(lora_request, len(prompts)))

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's vector (vLLM's LLM.embed), in the prompts' order, on an engine started with
        runner="pooling": the final hidden states of its prompt pooled as the engine's pooler_config says
        (by default the last token's, normalized). A bad prompt or params raise as generate's do, naming the
        prompt; a request the engine failed raises RuntimeError."""
        return [EmbeddingRequestOutput.from_base(out) for out in self._pool(prompts, pooling_params, use_tqdm)]

    def score(self, text_1: PromptType | Sequence[PromptType], text_2: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score with an embedding model: the cosine similarity of the vectors (embed's) of
        text_1's and text_2's prompts, one score per pair: 1:1, the one text_1 against each text_2 (1:N),
        or pair by pair (N:N)."""
        texts_1, texts_2 = _prompt_list(text_1, "text_1"), _prompt_list(text_2, "text_2")
        check_score_inputs(len(texts_1), len(texts_2))
        vectors = self._pool(texts_1 + texts_2, pooling_params, use_tqdm)
        pad_token_id = getattr(self.get_tokenizer(), "pad_token_id", None)
        return cosine_scores(vectors[:len(texts_1)], vectors[len(texts_1):], pad_token_id)

    def _pool(self, prompts, pooling_params, use_tqdm: bool) -> list[PoolingRequestOutput]:
        if self.llm_engine.config.model.pooler_config is None:
            raise ValueError("LLM.embed and LLM.score need an engine started with runner='pooling' "
                             "(vLLM's --runner pooling): LLM(model, runner='pooling')")
        prompts = _prompt_list(prompts, "prompts")
        params = self._params_list(PoolingParams() if pooling_params is None else pooling_params, len(prompts),
                                   PoolingParams)
        outputs = self._run(prompts, params, use_tqdm)
        for i, out in enumerate(outputs):
            if out.error is not None:
                raise RuntimeError(f"prompt {i}: the engine failed the request: {out.error}")
        return outputs

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat
        template. A message's content is a str or a list of OpenAI text parts
        ([{"type": "text", "text": ...}], joined by newlines). lora_request: as generate's."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine was started with skip_tokenizer_init")
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of message dicts or a list of conversations, "
                            f"got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages is empty: a conversation needs at least one message")
        conversations = list(messages) if isinstance(messages[0], (list, tuple)) else [messages]
        prompts = []
        for i, conversation in enumerate(conversations):
            text = tokenizer.apply_chat_template(chat_messages(i, conversation), chat_template=chat_template,
                                                 tokenize=False, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    @staticmethod
    def _params_list(params, n: int, kind: type = SamplingParams) -> list:
        """One `kind` (SamplingParams, asking only for the final output, or PoolingParams) per prompt."""
        name = "sampling_params" if kind is SamplingParams else "pooling_params"
        if isinstance(params, kind):
            params = [params] * n
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"{name} must be a {kind.__name__} or a list of them, got {type(params).__name__}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} {name} for {n} prompts")
        fields = {"output_kind": RequestOutputKind.FINAL_ONLY} if kind is SamplingParams else {}
        final = {}  # copy each distinct object once; the caller's stays as it was
        for i, p in enumerate(params):
            if not isinstance(p, kind):
                raise TypeError(f"prompt {i}: {name} must be a {kind.__name__}, got {type(p).__name__}")
            if id(p) not in final:
                try:  # replace validates again: the caller may have changed p since it was made
                    final[id(p)] = dataclasses.replace(p, **fields)
                except (ValueError, TypeError) as e:
                    raise _prompt_error(i, e) from e
        return [final[id(p)] for p in params]

    def _run(self, prompts: list, params: list[SamplingParams | PoolingParams], use_tqdm: bool,
             lora_requests: list[LoRARequest | None] | None = None) -> list[RequestOutput | PoolingRequestOutput]:
        if self._paused:
            raise ValueError("generation is paused: resume_generation() first")
        if self._asleep:
            raise ValueError("the engine is asleep: wake_up() first")
        inbox = queue.SimpleQueue()  # this call's finished outputs, from whichever caller ran the step
        with self._lock:
            ids = []
            try:
                for i, (prompt, p) in enumerate(zip(prompts, params)):
                    request_id = str(self._counter)
                    self._counter += 1
                    ids.append(request_id)  # before it is added: an interrupt inside add_request takes it back too
                    try:
                        self.llm_engine.add_request(request_id, prompt, p, lora_requests and lora_requests[i])
                    except (ValueError, TypeError) as e:
                        ids.pop()  # refused before it reached the engine
                        raise _prompt_error(i, e) from e
                    self._inboxes[request_id] = inbox
            except BaseException:
                self._take_back(ids)
                raise

        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        try:
            while len(finished) < len(ids):
                with self._lock:
                    if inbox.empty():  # else another caller's step finished some of ours
                        self._step()
                while not inbox.empty():
                    out = inbox.get()
                    finished[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids)
                    if isinstance(out, RequestOutput):
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, "
                                        f"output: {out_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        except BaseException:  # an interrupt, a dead engine: leave none of ours running
            with self._lock:
                self._take_back([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        failed = collections.Counter(o.error for o in finished.values() if _failed(o))
        for error, count in failed.items():
            logger.warning("%d of %d requests failed: %s", count, len(ids), error)
        return [finished[i] for i in ids]

    def _step(self) -> None:
        """One engine step (the lock held); each finished output goes to its owner's inbox."""
        if not self.llm_engine.has_unfinished_requests():
            raise RuntimeError("requests of a generate call left the engine without an output "
                               "(aborted through llm_engine?)")
        for out in self.llm_engine.step():
            inbox = self._inboxes.pop(out.request_id, None) if out.finished else None
            if inbox is not None:  # None: not finished, or added to llm_engine directly
                inbox.put(out)

    def _take_back(self, request_ids: list[str]) -> None:
        """Abort a call's unfinished requests (the lock held)."""
        for request_id in request_ids:
            self._inboxes.pop(request_id, None)
        try:
            self.llm_engine.abort_request(request_ids)
        except EngineDeadError:
            pass  # its requests died with the core


def _prompt_list(prompts, name: str) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"{name} must be a str, a dict or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _lora_list(lora_request, n: int) -> list | None:
    """One LoRARequest (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_request for {n} prompts")
    return list(lora_request)


def _failed(out: RequestOutput | PoolingRequestOutput) -> bool:
    if isinstance(out, PoolingRequestOutput):
        return out.error is not None
    return any(c.finish_reason == "error" for c in out.outputs)


def _prompt_error(i: int, error: Exception) -> Exception:
    """The error, as a TypeError or ValueError, with the prompt's index in front."""
    kind = TypeError if isinstance(error, TypeError) else ValueError
    return kind(f"prompt {i}: {error}")
