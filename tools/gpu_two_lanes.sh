#!/usr/bin/env bash
# Two jobs at once on the two-GPU machine (nvidia-h200-x2), from the repository root: one build, then lane 0 on
# GPU 0 and lane 1 on GPU 1, each on its own half of the CPU cores (so a CPU-heavy lane, e.g. pytest workers or the
# stress run's CPU oracle, does not slow the other's launches), each with its own output folder:
#
#   tools/gpu_two_lanes.sh 'LANE0 COMMAND' 'LANE1 COMMAND'      e.g.
#   tools/gpu_two_lanes.sh 'tools/gpu_check.sh test,sanitize' 'tools/gpu_check.sh stress'
#
# A lane's command runs with CUDA_VISIBLE_DEVICES set, SKIP_BUILD=1 (gpu_check.sh uses the installed build) and
# OUT=$OUT/laneN; its output goes to $OUT/laneN/lane.log and the folder comes back as one archive,
# $OUT/laneN.tgz (the device tool returns only a few files). Exit: 0 when both lanes exit 0.
set -uo pipefail
(($# == 2)) || { echo "usage: tools/gpu_two_lanes.sh 'LANE0 COMMAND' 'LANE1 COMMAND'" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
OUT="$OUT/build" tools/gpu_check.sh build >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
half=$(( $(nproc) / 2 ))
cpus=("0-$((half - 1))" "$half-$((2 * half - 1))")
pids=()
for lane in 0 1; do
  dir=$OUT/lane$lane
  mkdir -p "$dir"
  cmd=$([[ $lane == 0 ]] && echo "$1" || echo "$2")
  echo "lane $lane (GPU $lane, CPUs ${cpus[$lane]}): $cmd"
  CUDA_VISIBLE_DEVICES=$lane SKIP_BUILD=1 OUT=$dir PYTEST_WORKERS=${PYTEST_WORKERS:-8} \
    taskset -c "${cpus[$lane]}" bash -c "$cmd" >"$dir/lane.log" 2>&1 &
  pids+=($!)
done
status=0
for lane in 0 1; do
  wait "${pids[$lane]}"; rc=$?
  (( rc != 0 )) && status=1
  echo "== lane $lane: exit $rc; its log's end:"
  tail -40 "$OUT/lane$lane/lane.log"
  tar czf "$OUT/lane$lane.tgz" -C "$OUT" "lane$lane" && rm -rf "$OUT/lane$lane"
done
tar czf "$OUT/build.tgz" -C "$OUT" build build.txt 2>/dev/null && rm -rf "$OUT/build" "$OUT/build.txt"
exit $status
