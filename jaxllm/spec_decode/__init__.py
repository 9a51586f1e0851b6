"""Speculative decoding: the proposers that guess a request's next tokens (its drafts).

The scheduler asks for drafts when it schedules a decoding request, schedules them
with the request's next token, and the step's forward scores every draft position at
once; the runner keeps the run of drafts the model's own samples agree with, and the
token after it (worker/model_runner.py). Under synchronous scheduling n-gram drafts are
made here, from the request's tokens; a draft model's or an EAGLE head's, and n-gram ones
under asynchronous scheduling, are made by the runner at the end of the step before
(worker/draft_model.py, worker/eagle.py, worker/ngram_drafter.py) and only kept here until
the request is scheduled again."""


def make_proposer(config):
    """The proposer of config.speculative (a Config), or None without speculative decoding."""
    if config.speculative is None:
        return None
    method, k = config.speculative.method, config.speculative.num_speculative_tokens
    if config.drafts_on_device:
        from jaxllm.spec_decode.draft_model import RunnerDrafts
        # The KV a drafter writes past a step's tokens: a draft model's k steps, an EAGLE head's k - 1.
        return RunnerDrafts({"draft_model": k, "ngram": 0}.get(method, k - 1))
    from jaxllm.spec_decode.ngram import NgramProposer
    return NgramProposer(config.speculative)
