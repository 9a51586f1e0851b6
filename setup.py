"""Package discovery: pyproject.toml holds the metadata; this maps the repository's three
parts onto one package (kernels/ -> jaxllm.kernels, models/ -> jaxllm.models) and lets
setuptools find every subpackage under each, so a new folder with an __init__.py ships
without being listed anywhere."""
from setuptools import find_packages, setup

ROOTS = {"jaxllm": "jaxllm", "jaxllm.kernels": "kernels", "jaxllm.models": "models"}

packages = []
for name, folder in ROOTS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
