"""A reinforcement-learning loop with jaxllm inside the JAX program: the trainer's params are
the engine's (no copy through the host, no file), generation samples rollouts with their
logprobs, a policy-gradient step (optax) updates the params, and update_weights hands them
back to the engine without a restart or a recompilation.

The reward is a toy (the share of a sample's tokens below an id), so the loop runs
on a CPU in seconds with a tiny model; the shape of the loop is what a GRPO or PPO trainer
does. With batch_invariant=True the engine's logprobs of its samples are bitwise those the
trainer's own forward gives, which the loop checks at every iteration.

    python examples/rl_loop.py                          # the embedded SmolLM2-135M-Instruct
    python examples/rl_loop.py --model /path/to/hf-folder --iterations 10
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF folder or a .gguf file (default: the embedded model)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8, help="rollouts per iteration")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--vocab-split", type=int, default=128,
                        help="the reward: the share of a sample's tokens below this id")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=128, max_num_seqs=16, skip_tokenizer_init=True, batch_invariant=True,
              enable_multiprocessing=False, show_progress=False)
    params = jax.tree.map(jnp.copy, llm.get_params())  # the trainer's own copy, on the same devices
    logprobs_fn = jax.jit(llm.get_logprobs_fn())
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)
    prompt = [1, 5, 6, 7]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)

    def loss_fn(params, sequences, advantages):
        """REINFORCE: -mean(advantage x the log probability of the sample's own tokens)."""
        logprobs = logprobs_fn(params, sequences)[:, len(prompt) - 1:]  # [B, S]: one ragged batch, not a vmap
        return -jnp.mean(advantages * logprobs.sum(-1))

    @jax.jit
    def train_step(params, opt_state, sequences, advantages):
        grads = jax.grad(loss_fn)(params, sequences, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    engine_compilations = 0
    compilations = lambda: llm.llm_engine.get_stats()["num_compilations"]  # the process's
    for iteration in range(args.iterations):
        before = compilations()
        outs = llm.generate([{"prompt_token_ids": prompt}] * args.samples,
                            [SamplingParams(**{**vars(sampling), "seed": iteration * args.samples + i})
                             for i in range(args.samples)], use_tqdm=False)
        engine_compilations += compilations() - before
        samples = [o.outputs[0] for o in outs]
        sequences = jnp.array([prompt + s.token_ids for s in samples], jnp.int32)
        # The engine's logprobs of its samples are the trainer's forward's, bit for bit.
        engine = np.array([[d[t].logprob for d, t in zip(s.logprobs, s.token_ids)] for s in samples], np.float32)
        trainer = np.asarray(logprobs_fn(params, sequences))[:, len(prompt) - 1:]
        assert np.array_equal(engine, trainer), "the engine's logprobs differ from the trainer's forward"
        rewards = np.array([sum(t < args.vocab_split for t in s.token_ids) / len(s.token_ids) for s in samples],
                           np.float32)
        advantages = jnp.asarray((rewards - rewards.mean()) / (rewards.std() + 1e-6))
        params, opt_state = train_step(params, opt_state, sequences, advantages)
        before = compilations()
        llm.update_weights(params)
        engine_compilations += compilations() - before
        print(f"iteration {iteration}: mean reward {rewards.mean():.3f}, the engine's compilations {engine_compilations}")
    assert engine_compilations == 0, "the engine compiled in a generate or an update"
    llm.shutdown()
    print("ok: the engine's logprobs matched the trainer's at every iteration, and nothing in it compiled")


if __name__ == "__main__":
    main()
