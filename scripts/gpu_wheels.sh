#!/usr/bin/env bash
# Downloads into .whl/ (or $WHEEL_DIR) the wheels a GPU image without internet access lacks,
# for its Python 3.12 on x86-64 Linux: the image this was written for has jax, jaxlib with its
# CUDA plugin, flax, orbax, transformers, tokenizers, safetensors, torch and triton, and none
# of the packages below. Carry the folder to the GPU machine and install it there with
#   bash scripts/gpu_run.sh --wheels .whl PART...
# which runs, before the parts:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# /tmp/site comes first on the path, so a wheel here shadows the image's copy of the same
# package: every pin below is what our .venv runs (pyproject.toml's).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=${WHEEL_DIR:-.whl}
# jax-triton 0.4.x needs triton >= 3.7; the image has triton 3.6. Their other needs
# (jax, triton, absl-py) are already in the image.
# gguf: GGUF files; pyzmq, msgspec: the engine-core process; cloudpickle, a dependency now too: the engine
# args sent to that process (a logits processor class from a script's __main__); llguidance: structured outputs
WHEELS=("jax-triton==0.3.1" "gguf==0.19.0" "pyzmq==27.3.0" "msgspec==0.23.0" "cloudpickle==3.1.3"
        "llguidance==1.9.1")
# `jaxllm serve` (fastapi, uvicorn, prometheus-client) and `jaxllm bench serve` (aiohttp),
# with everything they import in turn. pydantic-core, aiohttp, multidict, yarl, frozenlist
# and propcache are compiled (cp312 manylinux); the rest are pure Python.
WHEELS+=(
  "fastapi==0.165.0" "starlette==1.10.0" "anyio==4.16.0" "idna==3.20" "annotated-doc==0.0.7"
  "opentelemetry-api==1.45.2"  # fastapi.telemetry imports it whether or not tracing is on
  "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"  # pydantic 2.14 needs >= 4.16
  "uvicorn==0.54.0" "click==8.5.1" "h11==0.16.0"
  "prometheus-client==0.26.0"
  "aiohttp==3.14.5" "aiohappyeyeballs==2.7.1" "aiosignal==1.4.0" "attrs==26.1.0" "frozenlist==1.8.0"
  "multidict==7.2.1" "propcache==0.5.4" "yarl==1.25.1"
)
download() {
  local dest=$1; shift
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$dest" "$@"
}
download "$DEST" "${WHEELS[@]}"
# PLOT=1: matplotlib and what it imports (24 MB; numpy and packaging are in the image), for the
# plot of gpu_run.sh's hf-compare part. In their own folder, which the other parts' *.whl leaves out.
if [ -n "${PLOT:-}" ]; then
  download "$DEST/plot" "matplotlib==3.11.2" "contourpy==1.4.0" "cycler==0.12.1" "fonttools==4.68.0" \
    "kiwisolver==1.5.1" "pillow==13.0.0" "pyparsing==3.3.3" "python-dateutil==2.9.0.post0" "six==1.17.0"
  echo "plot: $(du -ch "$DEST"/plot/*.whl | tail -1 | cut -f1) in $(ls "$DEST"/plot/*.whl | wc -l) wheels"
fi
ls -l "$DEST"
echo "total: $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) in $(ls "$DEST"/*.whl | wc -l) wheels"
