#!/usr/bin/env bash
# compute-sanitizer over csrc/tools/memcheck_smoke.py: memcheck (out-of-range slots, pages and lengths), initcheck
# (every slot written first, --full) and racecheck. Racecheck of the whole smoke in one process takes over four
# minutes on an H200, so it runs as two processes: the extend kernels, and every other kernel. All four run at once.
# Usage, from the repository root with kvq._C built for this GPU: csrc/tools/sanitize.sh [outdir]
# Prints one line per run; exits 0 only if every run is clean. The full reports are in outdir.
set -u
out=${1:-.}
mkdir -p "$out"
smoke=(python csrc/tools/memcheck_smoke.py)
cs=(compute-sanitizer --error-exitcode 9)

run() {  # name, then the command; the summary line of its report
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" | tail -1)"
  return $rc
}

# The four runs share the one GPU (on an H200 together 170 s, the extend kernels' racecheck).
pids=()
run memcheck "${cs[@]}" --tool memcheck "${smoke[@]}" &
pids+=($!)
run initcheck "${cs[@]}" --tool initcheck "${smoke[@]}" --full &
pids+=($!)
run racecheck-extend "${cs[@]}" --tool racecheck --kernel-name kns=extend_kernel "${smoke[@]}" &
pids+=($!)
run racecheck-rest "${cs[@]}" --tool racecheck --kernel-name-exclude kns=extend_kernel "${smoke[@]}" &
pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
