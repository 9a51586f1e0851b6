"""A regular install (`pip install .`, the wheel) holds every module of the three parts and
runs the engine from outside the checkout: the editable install that `make` does would hide
a package the wheel leaves out."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.conftest import ROOT, tiny_llama_with_tokenizer, write_char_tokenizer

pytestmark = pytest.mark.timeout(600)
PARTS = {"jaxllm": "jaxllm", "kernels": "jaxllm.kernels", "models": "jaxllm.models"}


def source_modules() -> set[str]:
    """Every module of the checkout, by the name it has once installed."""
    names = set()
    for folder, package in PARTS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for f in files:
                if f.endswith(".py"):
                    names.add(prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}")
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """A fresh virtual environment with the wheel installed, its dependencies seen through
    this environment's site-packages (a path, not a site dir: the editable install's finder
    there is not run). Returns the environment's folder."""
    tmp = tmp_path_factory.mktemp("install")
    # A copy of the sources alone: setuptools builds in the tree, and a build/ folder left there
    # by an earlier build would slip its stale modules into the wheel.
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "tests", "__pycache__"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source), "-w", str(wheels)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("jaxllm-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return str(venv)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_wheel_installs_every_module_and_each_imports(installed, tmp_path):
    script = ("import importlib, pkgutil, jaxllm, sys\n"
              "assert 'site-packages' in jaxllm.__file__, jaxllm.__file__\n"
              "names = ['jaxllm'] + [m.name for m in pkgutil.walk_packages(jaxllm.__path__, 'jaxllm.')]\n"
              "for name in names: importlib.import_module(name)\n"
              "print('\\n'.join(names))\n")
    result = subprocess.run([os.path.join(installed, "bin", "python"), "-c", script], cwd=tmp_path,
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(result.stdout.split()) == source_modules()


def test_the_installed_command_generates_from_outside_the_checkout(installed, tmp_path):
    (tmp_path / "model").mkdir()
    model = tiny_llama_with_tokenizer(tmp_path / "model", write_char_tokenizer)
    result = subprocess.run([os.path.join(installed, "bin", "jaxllm"), "generate", "--model", model,
                             "--prompt", "hello", "--max-tokens", "4", "--ignore-eos", "--max-model-len", "64"],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "(4 tokens, finish_reason=length)" in result.stdout, result.stdout[-2000:]
