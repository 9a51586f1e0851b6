"""The examples run as a user runs them, on the tiny model."""
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.mark.usefixtures("warm_up")
def test_the_rl_loop_matches_the_trainers_logprobs_and_compiles_nothing_across_its_updates():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rl_loop.py"), "--model",
                             tiny_model("llama"), "--iterations", "10"],
                            capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len([line for line in lines if line.startswith("iteration ")]) == 10
    assert lines[-1].startswith("ok: the engine's logprobs matched the trainer's at every iteration")
