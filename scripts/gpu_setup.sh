# Sourced by the scripts/gpu_*.sh device runs (carry .whl, made by scripts/gpu_wheels.sh):
# installs the wheels the GPU image lacks and jaxllm itself (editable, as in `make`: the
# checkout's jaxllm/ then imports with jaxllm.models and jaxllm.kernels).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
