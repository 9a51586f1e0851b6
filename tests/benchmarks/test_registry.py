"""The benches' registry: each bench is a module with a docstring, HELP, add_cli_args and main;
those that build an engine take the engine's flags, the others only their own."""
import pytest

from jaxllm.benchmarks import ENGINE_BENCHES, OTHER_BENCHES
from jaxllm.cli import main


@pytest.mark.parametrize("name", [*ENGINE_BENCHES, *OTHER_BENCHES])
def test_a_bench_says_what_it_measures(name):
    module = {**ENGINE_BENCHES, **OTHER_BENCHES}[name]
    assert module.__doc__.startswith(f"`jaxllm bench {name}")
    assert module.HELP and callable(module.add_cli_args) and callable(module.main)


def help_of(capsys, name: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", OTHER_BENCHES)
def test_a_bench_of_no_engine_takes_no_engine_flags(capsys, name):
    assert "--max-model-len" not in help_of(capsys, name)


@pytest.mark.parametrize("name", ENGINE_BENCHES)
def test_an_engine_bench_takes_the_engine_flags(capsys, name):
    assert "--max-model-len" in help_of(capsys, name)
