"""Token masks made on the host each step, for what depends on the tokens just generated:
a structured output's grammar (llguidance, jaxllm.structured_output) and bad words of
more than one token (the last token is masked while the output ends with the others).
A mask row is [ceil(vocab / 32)] int32, bit t % 32 of word t // 32 set where token t
is allowed; the sampler applies it on the device (processors.apply_processors).
"""
import logging
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxllm.request import Request

logger = logging.getLogger(__name__)


def fill_bitmask(entries: list[tuple["Request", list[int], int]], bitmask: np.ndarray) -> dict[str, str]:
    """Narrow the rows of `bitmask` [R, W] int32 (all allowed on entry) for each (request,
    pending, i)'s next token, in row i. `pending`: the request's tokens sampled but not yet
    in its output_token_ids (the previous step's, still in flight). Returns {request id: error}
    for the requests whose mask failed: their rows allow every token, and they must end."""
    failed: dict[str, str] = {}
    grammars = []
    for request, pending, i in entries:
        if request.grammar is not None:
            try:
                _advance(request, pending)
                grammars.append((request, i))
            except Exception as e:
                _fail(request, e, failed)
    if grammars:
        from jaxllm.structured_output import fill_bitmasks
        try:
            fill_bitmasks([(request.grammar, i) for request, i in grammars], bitmask)
        except Exception:  # find whose grammar it was: one at a time
            for request, i in grammars:
                try:
                    request.grammar.fill_bitmask(bitmask[i])
                except Exception as e:
                    bitmask[i] = -1
                    _fail(request, e, failed)
    for request, pending, i in entries:  # after the grammars: their masks overwrite whole rows
        if request.bad_word_sequences and request.request_id not in failed:
            try:
                _mask_bad_words(request, pending, bitmask[i])
            except Exception as e:
                _fail(request, e, failed)
    return failed


def _fail(request, error: Exception, failed: dict[str, str]) -> None:
    logger.exception("request %s: its token mask failed", request.request_id)
    failed[request.request_id] = f"token mask: {type(error).__name__}: {error}"


def _mask_bad_words(request, pending: list[int], row: np.ndarray) -> None:
    longest = max(len(w) for w in request.bad_word_sequences)
    tail = request.output_token_ids[-(longest - 1):] + pending
    for word in request.bad_word_sequences:
        prefix = word[:-1]
        if tail[-len(prefix):] == prefix:
            forbid(row, word[-1])


def _advance(request, pending: list[int]) -> None:
    """Feed the request's grammar the tokens it has not seen."""
    grammar = request.grammar
    if grammar.is_error():
        return
    for token_id in request.output_token_ids[grammar.num_accepted:] + pending:
        if not grammar.accept_token(token_id):
            # The mask forbade it, so only a bug gets here; the grammar then allows only EOS.
            logger.error("request %s: the grammar rejected token %d (%s); only EOS is allowed now",
                         request.request_id, token_id, grammar.error())
            return


def forbid(row: np.ndarray, token_id: int) -> None:
    bits = row.view(np.uint32)
    bits[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
