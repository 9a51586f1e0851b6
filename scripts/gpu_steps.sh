# Sourced by the budgeted device runs (gpu_bench.sh, gpu_serve.sh) after they set T0 and
# BUDGET_S: `left` says the seconds left; `step EST NAME CMD...` runs CMD if its estimate
# EST fits in the time left (keeping 20 s for the table), under a timeout of what is left,
# and says SKIPPED or FAILED (on fd 3, past the pipes that keep a command's tail) rather
# than stopping the run; 1 if skipped or failed.
left() { echo $(( BUDGET_S - (SECONDS - T0) )); }
exec 3>&1
step() {
  local est=$1 name=$2; shift 2
  local rest=$(( $(left) - 20 ))
  if [ "$rest" -lt "$est" ]; then echo "SKIPPED $name: ${rest} s left, it needs ~${est} s" >&3; return 1; fi
  echo "== $name ($(( SECONDS - T0 )) s in, ${rest} s left)" >&3
  timeout -k 20 "$rest" "$@"
  local status=$?
  [ $status = 0 ] || echo "FAILED $name (exit $status)" >&3
  return $status
}
