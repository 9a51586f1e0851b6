"""The token masks the core makes for a step, for what depends on the tokens just generated:
a structured output's grammar (llguidance, jaxllm.structured_output) and bad words of more
than one token (the last token is masked while the output ends with the others). The core
makes them once every step before has been applied, so each request's grammar has accepted
all its tokens (EngineCore.step); the runner's sampler applies them on the device
(sample/processors.py apply_processors).

A mask row is [ceil(vocab / 32)] int32, bit t % 32 of word t // 32 set where token t is allowed.
"""
import logging

import numpy as np

from jaxllm.contracts.step import TokenMasks
from jaxllm.request import Request
from jaxllm.utils import cdiv

logger = logging.getLogger(__name__)


def make_token_masks(requests: list[Request], vocab_size: int) -> tuple[TokenMasks, dict[str, str]]:
    """The masks of `requests` (host-masked, sampling this step), and {request id: error} for
    those whose mask failed: their rows allow every token, and they must end."""
    bitmask = np.full((len(requests), cdiv(vocab_size, 32)), -1, np.int32)
    failed: dict[str, str] = {}
    # A request still thinking (grammar_start None) keeps its row of ones: its grammar waits.
    grammars = [(r, i) for i, r in enumerate(requests) if r.grammar is not None and r.grammar_start is not None]
    if grammars:
        from jaxllm.structured_output import fill_bitmasks
        try:
            fill_bitmasks([(r.grammar, i) for r, i in grammars], bitmask)
        except Exception:  # find whose grammar it was: one at a time
            for r, i in grammars:
                try:
                    r.grammar.fill_bitmask(bitmask[i])
                except Exception as e:
                    bitmask[i] = -1
                    _fail(r, e, failed)
    for i, r in enumerate(requests):  # after the grammars: their masks overwrite whole rows
        if r.bad_word_sequences and r.request_id not in failed:
            try:
                _mask_bad_words(r, bitmask[i])
            except Exception as e:
                _fail(r, e, failed)
    return TokenMasks([r.request_id for r in requests], bitmask), failed


def _fail(request: Request, error: Exception, failed: dict[str, str]) -> None:
    logger.exception("request %s: its token mask failed", request.request_id)
    failed[request.request_id] = f"token mask: {type(error).__name__}: {error}"


def _mask_bad_words(request: Request, row: np.ndarray) -> None:
    longest = max(len(w) for w in request.bad_word_sequences)
    tail = request.output_token_ids[-(longest - 1):]
    for word in request.bad_word_sequences:
        prefix = word[:-1]
        if tail[-len(prefix):] == prefix:
            forbid(row, word[-1])


def forbid(row: np.ndarray, token_id: int) -> None:
    bits = row.view(np.uint32)
    bits[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
