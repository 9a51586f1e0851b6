"""The engine core's view of one request: tokens, progress, and KV blocks."""
import enum
import logging

from jaxllm.contracts.engine_core import EngineCoreRequest
from jaxllm.lora.request import LoRARequest
from jaxllm.pooling_params import PoolerConfig, PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], seed: int, bad_words_token_ids: list[list[int]] = (),
                 pooling_params: PoolingParams | None = None, pools_every_token: bool = False,
                 lora_request: LoRARequest | None = None):
        """pooling_params: a pooling request's (it ends at its prompt's end, with its pooled hidden state);
        pools_every_token: its engine pools hidden states before the last (PoolerConfig.reads_every_token);
        lora_request: the LoRA adapter it runs on."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = len(self.prompt_token_ids)  # prompt + output; kept, not derived: the step loop reads it often
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.seed = seed  # sampling key of this request; its samples do not depend on the batch
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens a step still on the device may take: its sampled one and its drafts (all, until it lands).
        # Their KV slots are scheduled, their ids not yet known.
        self.num_output_placeholders = 0
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens
        # Bad words of one token are masked always (the processors' bias row); longer ones
        # only after their first tokens, which the host checks each step.
        self.banned_token_ids = sorted({w[0] for w in bad_words_token_ids if len(w) == 1})
        self.bad_word_sequences = [list(w) for w in bad_words_token_ids if len(w) > 1]
        self.grammar = None  # a structured_output.GrammarMatcher (EngineCore.add_request)
        structured = sampling_params.structured_outputs
        self._reasoning_end = None if structured is None else structured.reasoning_end_token_id
        # Where the grammar's tokens start in the output: 0, or just past the end of a reasoning
        # model's thinking (None until it is generated: until then the grammar masks nothing).
        self.grammar_start: int | None = 0 if self._reasoning_end is None else None
        self._thinking_scanned = 0  # output tokens already searched for the end of thinking
        # Prompt logprobs: the next prompt position whose logprobs are still to send (the first has none).
        self.next_prompt_logprob = 1
        self.first_scheduled_time: float | None = None
        self.block_hashes: list[bytes] = []  # of its full blocks, for the prefix cache (core/kv_cache_utils.py)
        self.lora_request = lora_request
        # What else its blocks' hashes cover: another adapter's KV of the same tokens differs.
        self.block_hash_keys = () if lora_request is None else (lora_request.lora_name, lora_request.lora_int_id)
        self.num_cached_tokens = -1  # prompt tokens the prefix cache held when first scheduled; -1 until then
        self.pooling_params = pooling_params
        # Prompt logprobs, and a pooler that reads every prompt token's hidden state, need each prompt
        # position computed: no prefix is read from the cache (vLLM's skip_reading_prefix_cache).
        self.skip_reading_prefix_cache = (sampling_params.prompt_logprobs is not None
                                          or (pooling_params is not None and pools_every_token))

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, pooler: PoolerConfig | None = None) -> "Request":
        """pooler: the engine's (None: it does not pool)."""
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params,
                   request.eos_token_ids, request.seed, request.bad_words_token_ids, request.pooling_params,
                   pooler is not None and pooler.reads_every_token, request.lora_request)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_host_mask(self) -> bool:
        """Whether each step's token mask is made on the host (after the previous token is known)."""
        return self.grammar is not None or bool(self.bad_word_sequences)

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids min_tokens holds back: EOS (unless ignore_eos) and the stop token ids."""
        return [*self.eos_token_ids, *self.sampling_params.stop_token_ids]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole history."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    def advance_grammar(self) -> None:
        """Feed the grammar the output tokens it has not seen (after the thinking, if any)."""
        grammar = self.grammar
        if grammar.is_error() or (self.grammar_start is None and not self._thinking_ended()):
            return
        for token_id in self.output_token_ids[self.grammar_start + grammar.num_accepted:]:
            if not grammar.accept_token(token_id):
                # The mask forbade it, so only a bug gets here; the grammar then allows only EOS.
                logger.error("request %s: the grammar rejected token %d (%s); only EOS is allowed now",
                             self.request_id, token_id, grammar.error())
                return

    def _thinking_ended(self) -> bool:
        """Whether the output holds the end of thinking; sets grammar_start when it first does."""
        tokens = self.output_token_ids
        for i in range(self._thinking_scanned, len(tokens)):
            if tokens[i] == self._reasoning_end:
                self.grammar_start = i + 1
                return True
        self._thinking_scanned = len(tokens)
        return False

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request (EOS, a stop
        token id, max_tokens, or the model length). Stop strings are checked by
        the OutputProcessor, which aborts the request through the engine."""
        n_out = self.num_output_tokens
        last = self.output_token_ids[-1]
        # Length first, as vLLM: an EOS that is also the last allowed token finishes with "length".
        if (self.max_tokens is not None and n_out >= self.max_tokens) or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in self.sampling_params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False


def check_token_ids(request: EngineCoreRequest, vocab_size: int) -> None:
    """Every token id a request carries is in [0, vocab_size): each indexes a vocabulary row of
    the step. The front end checks them too; this guards the core from any other sender."""
    params = request.sampling_params
    fields = {"prompt_token_ids": request.prompt_token_ids, "stop_token_ids": params.stop_token_ids,
              "allowed_token_ids": params.allowed_token_ids, "logit_bias": params.logit_bias,
              "bad_words": [t for word in request.bad_words_token_ids for t in word],
              "eos_token_ids": request.eos_token_ids}
    structured = params.structured_outputs
    if structured is not None and structured.reasoning_end_token_id is not None:
        fields["structured_outputs.reasoning_end_token_id"] = [structured.reasoning_end_token_id]
    for name, ids in fields.items():
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # builtins: a 100k-token prompt in about 1 ms
            outside = [t for t in ids if not 0 <= t < vocab_size]
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
