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


def fill_bitmask(entries: list[tuple["Request", list[int], int]], bitmask: np.ndarray) -> None:
    """Narrow the rows of `bitmask` [R, W] int32 (all allowed on entry) for each (request,
    pending, i)'s next token, in row i. `pending`: the request's tokens sampled but not yet
    in its output_token_ids (the previous step's, still in flight)."""
    grammars = []
    for request, pending, i in entries:
        if request.grammar is not None:
            _advance(request, pending)
            grammars.append((request.grammar, i))
    if grammars:
        from jaxllm.structured_output import fill_bitmasks
        fill_bitmasks(grammars, bitmask)
    for request, pending, i in entries:
        if request.bad_word_sequences:
            longest = max(len(w) for w in request.bad_word_sequences)
            tail = request.output_token_ids[-(longest - 1):] + pending
            for word in request.bad_word_sequences:
                prefix = word[:-1]
                if tail[-len(prefix):] == prefix:
                    forbid(bitmask[i], word[-1])


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
