#!/usr/bin/env bash
# The attention kernels on the GPU (one device call; carry .whl, made by
# scripts/gpu_wheels.sh): sets up as scripts/gpu_setup.sh does, runs
# the gpu-marked kernel tests, then scripts/bench_attention.py with the given arguments.
# Usage on the device: bash scripts/gpu_kernels.sh [bench_attention.py arguments]
set -eo pipefail
source "$(dirname "$0")/gpu_setup.sh"
# Time limits: a kernel that deadlocks must not eat the call. The bench runs even when
# a test fails (it reports which kernels fail its own check), but the script then exits
# with the tests' status: pipefail gives the pipeline pytest's (or timeout's) status, not tail's.
status=0
timeout ${TEST_S:-240} python3 -m pytest -q -x -m gpu tests/kernels/test_mosaic_attention.py \
  tests/kernels/test_attention.py 2>&1 | tail -25 || status=$?
timeout ${BENCH_S:-330} python3 scripts/bench_attention.py "$@" || status=$?
exit $status
