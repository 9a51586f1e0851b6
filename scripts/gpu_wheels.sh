#!/usr/bin/env bash
# Downloads into .whl/ the wheels the GPU image lacks (../shared/GPU.md), for its
# Python 3.12 on x86-64 Linux. A device command that needs them carries .whl and
# starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# jax-triton 0.4.x needs triton >= 3.7; the image has triton 3.6. Their other needs
# (jax, triton, absl-py) are already in the image.
# gguf: GGUF files; pyzmq, msgspec: the engine-core process; llguidance: structured outputs
WHEELS=("jax-triton==0.3.1" "gguf==0.19.0" "pyzmq==27.3.0" "msgspec==0.23.0" "llguidance==1.9.1")
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls -l .whl
