"""Per-request grammar state over a model's vocabulary, and the token bitmask it writes.

Bitmask layout (llguidance's, and what the engine's JAX mask reads): a row of
bitmask_words(vocab_size) int32 words; token t is allowed when bit t % 32 of word t // 32
is set. E.g. vocab_size 40 -> 2 words; only token 33 allowed -> [0, 0b10].
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import llguidance
import numpy as np

from jaxllm.structured_output.grammar import constraint_kind, grammar_text

if TYPE_CHECKING:
    from jaxllm.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def apply_bitmask_numpy(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The plain reference of the mask: logits [R, V] float32, bitmask [R, W] int32 with
    W >= bitmask_words(V) -> a copy of logits [R, V] with disallowed tokens at -inf."""
    num_rows, vocab_size = logits.shape
    if bitmask.shape[0] != num_rows or bitmask.shape[1] < bitmask_words(vocab_size):
        raise ValueError(f"bitmask must be [{num_rows}, >= {bitmask_words(vocab_size)}] for logits "
                         f"{list(logits.shape)}, got {list(bitmask.shape)}")
    # [R, W] -> [R, W, 32] bits, word-major: bit b of word w is token 32 * w + b.
    bits = (bitmask[:, :, None] >> np.arange(32, dtype=np.int32)) & 1
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size].astype(bool)
    return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)


class GrammarCompiler:
    """Builds matchers for one model: its tokenizer (a transformers fast tokenizer), its
    logits width `vocab_size` (>= the tokenizer's; ids past the tokenizer's are padding,
    never allowed) and its EOS ids (the first the tokenizer holds is the one a finished grammar allows)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size ({vocab_size}) must be >= the tokenizer's {len(tokenizer)} tokens")
        # The model's EOS ends a grammar; a tokenizer of another model (EngineArgs.tokenizer) may
        # lack it, and then its own EOS does.
        eos = [t for t in eos_token_ids if t < len(tokenizer)] or [tokenizer.eos_token_id]
        if eos[0] is None:
            raise ValueError("eos_token_ids must hold the model's EOS id (a grammar ends with it)")
        self.vocab_size = vocab_size
        self.eos_token_id = eos[0]
        import llguidance.hf  # imports transformers (2 s): not on SamplingParams' path through grammar.py

        # About 0.5 s for a 50k vocabulary: once per engine.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=self.eos_token_id)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of `params`'s constraint. Raises ValueError naming the
        kind when the grammar does not fit this tokenizer (checked params rarely do not)."""
        # log_level 0: llguidance would print each rejected token to stderr; the engine reports errors.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{constraint_kind(params)}: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """Where one request stands in its grammar. The engine calls accept_token for each
    sampled token, in order, and fill_bitmask before each sampling step."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0  # tokens consumed so far

    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id`; False if the grammar rejects it. A rejection is final:
        from then on the mask allows only EOS, so the request ends."""
        if not self._matcher.consume_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the tokens allowed next into `row` [bitmask_words(vocab_size)] int32, in
        place (a row of the engine's persistent [max_num_seqs, W] buffer). Once the grammar
        is complete, or after a rejected token, only EOS is allowed."""
        words = bitmask_words(self.vocab_size)
        if row.shape != (words,) or row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"row must be a contiguous [{words}] int32 array, got {row.dtype} {list(row.shape)}")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def is_terminated(self) -> bool:
        """True once nothing but EOS may follow (the grammar is complete, or a token was rejected)."""
        return self._matcher.is_stopped()

    def is_error(self) -> bool:
        """True after a rejected token; error() says why."""
        return self._matcher.is_error()

    def error(self) -> str:
        return self._matcher.get_error()


_executor: llguidance.LLExecutor | None = None  # llguidance's thread pool, made on first use


def fill_bitmasks(grammars: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Each (matcher, i)'s allowed next tokens into row i of `bitmask` [R, W] int32, in
    llguidance's threads (a JSON schema's mask takes about 0.1 ms of one core)."""
    global _executor
    if not grammars:
        return
    num_rows, words = bitmask.shape
    if words != bitmask_words(grammars[0][0].vocab_size) or bitmask.dtype != np.int32 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError(f"bitmask must be a contiguous [R, {bitmask_words(grammars[0][0].vocab_size)}] int32 "
                         f"array, got {bitmask.dtype} {list(bitmask.shape)}")
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(g._matcher, i) for g, i in grammars], bitmask.ctypes.data,
                                      words * 4, num_rows)
