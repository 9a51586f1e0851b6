"""What a user's script meets: `await llm.abort(id)` ends the stream it aborts, Ctrl-C stops
LLM.generate and leaves the LLM usable, and a logits processor class defined in the script
itself reaches the engine core process."""
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxllm import AsyncLLM, RequestOutputKind, SamplingParams
from tests.conftest import ROOT, tiny_model
from tests.engine.test_core_process import engine_args, wait_for_idle_core

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("warm_up_every_engine")]
MAX_TOKENS = 480  # more than the tiny model makes before the abort


def test_aborting_a_request_ends_its_stream_with_finish_reason_abort(char_llama):
    async def consume(llm, request_id, kind, started):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind)
        outs = []
        async for out in llm.generate("an endless story", params, request_id):
            outs.append(out)
            started.set()
        return outs

    async def run():
        with AsyncLLM.from_engine_args(engine_args(char_llama, max_model_len=512, num_gpu_blocks_override=120),
                                       show_progress=False) as llm:
            kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
            started = [asyncio.Event() for _ in kinds]
            tasks = [asyncio.create_task(consume(llm, f"r{i}", kind, started[i])) for i, kind in enumerate(kinds)]
            await asyncio.gather(*(e.wait() for e in started[:2]))
            await asyncio.sleep(0.05)  # FINAL_ONLY's request has run a while too
            start = time.monotonic()
            for i in range(len(kinds)):
                await llm.abort(f"r{i}")
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
            return results, time.monotonic() - start, await wait_for_idle_core(llm)

    (delta, cumulative, final), elapsed, stats = asyncio.run(run())
    assert elapsed < 2.0
    for outs in (delta, cumulative, final):
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    # One greedy prompt: what each stream took is a prefix of the same tokens, cut at the abort.
    streamed, whole = sum((o.outputs[0].token_ids for o in delta), []), cumulative[-1].outputs[0].token_ids
    assert 0 < len(whole) < MAX_TOKENS and 0 < len(streamed) < MAX_TOKENS and len(final) == 1
    # The requests reach the core one by one, so one may start a step after another.
    shorter = min(len(whole), len(streamed), len(final[0].outputs[0].token_ids))
    assert streamed[:shorter] == whole[:shorter] == final[0].outputs[0].token_ids[:shorter]
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def run_script(tmp_path, body: str, timeout_s: int = 240, interrupt_after: str | None = None):
    """Run `body` as a user's script in a session of its own (as a terminal's foreground job:
    SIGINT handled). With `interrupt_after`, send SIGINT to its whole process group, as Ctrl-C
    does, once it prints that line. Returns (returncode, stdout, stderr)."""
    script = tmp_path / "script.py"
    script.write_text("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                      + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(tmp_path / "stderr.txt", "w+") as stderr:  # a file: a full pipe would stall the script
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=env, cwd=tmp_path, start_new_session=True)
        stdout = ""
        try:
            if interrupt_after is not None:
                for line in proc.stdout:
                    stdout += line
                    if line.strip() == interrupt_after:
                        break
                time.sleep(1.0)
                os.killpg(proc.pid, signal.SIGINT)
            stdout += proc.communicate(timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:
            stdout += "\n(timed out)"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stderr.seek(0)
        return proc.returncode, stdout, stderr.read()


def test_ctrl_c_stops_generate_aborts_its_requests_and_leaves_the_llm_usable(tmp_path):
    body = f"""
    import time
    from jaxllm import LLM, SamplingParams
    llm = LLM({tiny_model("llama")!r}, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=16,
              show_progress=False)
    long = SamplingParams(max_tokens=250, ignore_eos=True)
    print("GENERATING", flush=True)
    start = time.monotonic()
    try:
        llm.generate([{{"prompt_token_ids": [1, 2, 3]}}] * 2000, long, use_tqdm=False)
        print("COMPLETED")
    except KeyboardInterrupt:
        print("INTERRUPTED", round(time.monotonic() - start, 1))
    stats = llm.llm_engine.get_stats()
    print("FREE", stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"])
    out = llm.generate({{"prompt_token_ids": [1, 2, 3]}}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    print("AFTER", len(out[0].outputs[0].token_ids))
    """
    code, stdout, stderr = run_script(tmp_path, body, interrupt_after="GENERATING")
    assert code == 0, stderr[-3000:]
    lines = stdout.split("\n")
    assert any(line.startswith("INTERRUPTED") for line in lines), stdout + stderr[-3000:]
    assert "FREE True" in lines and "AFTER 4" in lines, stdout
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_logits_processor_class_defined_in_the_script_runs_in_the_core_process(tmp_path):
    body = f"""
    import jax.numpy as jnp
    import numpy as np
    from jaxllm import LLM, SamplingParams
    from jaxllm.sample.logits_processor import LogitsProcessor

    FORCED = 42  # a global of the script: it travels with the class

    class OnlyForced(LogitsProcessor):
        def __init__(self, config):
            pass
        def update_state(self, batch_update):
            pass
        def state(self, rows):
            return np.zeros(len(rows), np.int32)
        def apply(self, state, logits):
            return jnp.where(jnp.arange(logits.shape[-1]) == FORCED, logits, -jnp.inf)

    llm = LLM({tiny_model("llama")!r}, skip_tokenizer_init=True, max_model_len=128, max_num_seqs=16,
              show_progress=False, logits_processors=[OnlyForced])
    out = llm.generate({{"prompt_token_ids": [1, 2, 3]}}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    print("TOKENS", out[0].outputs[0].token_ids)
    """
    code, stdout, stderr = run_script(tmp_path, body)
    assert code == 0 and "TOKENS [42, 42, 42]" in stdout, stdout + stderr[-3000:]
