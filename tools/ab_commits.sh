#!/usr/bin/env bash
# A/B of builds on the same GPU: the installed attnres (this tree, after tools/gpu_check.sh) against one or more
# source trees (e.g. `git archive 4aed4f9 cpp python CMakeLists.txt pyproject.toml README.md | tar x -C
# ab_src/4aed4f9`), each built into a private target folder (in parallel). Prints tools/ab_points.py's JSON for
# each build, alternating new, tree 1, tree 2, ... for AB_ROUNDS rounds (default 3), so that a drift of the GPU's
# state (clocks, temperature) shows as a spread across rounds instead of as a difference between builds;
# nvidia-smi samples the SM clock and power every 200 ms meanwhile ($OUT/ab_clocks.csv). Output: the lines in
# $OUT/ab.txt, one results file $OUT/ab.json (every run and the medians over the rounds), a summary on stdout.
#
#   tools/ab_commits.sh TREE [TREE...]        AB_REPEATS (default 25) sets ab_points.py's repeats; AB_POINTS ("T:N,...") its points
#
# For when the regression guard flags a point whose baseline was measured on another machine: same-run
# references do not see every machine difference (cluster kernels depend on the GPU's GPC layout, elementwise
# kernels do not); and, with several trees, to find the commit that moved a point.
set -euo pipefail
(($# >= 1)) || { echo "usage: tools/ab_commits.sh OLD_SOURCE_TREE [MORE_TREES...]" >&2; exit 2; }
out=${OUT:-.}
script=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ab_points.py
declare -A target
pids=()
for tree in "$@"; do
  src=$(realpath "$tree")  # a path, not a requirement name
  name=$(basename "$src")
  target[$name]=/tmp/attnres_ab/$name
  CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DATTNRES_CUDA=ON" python3 -m pip install --no-build-isolation \
    --no-deps -q --target "${target[$name]}" "$src" >"$out/ab_build_$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { echo "a build failed: $out/ab_build_*.log" >&2; exit 1; }; done
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 \
  >"$out/ab_clocks.csv" 2>/dev/null &
smi=$!
trap 'kill $smi 2>/dev/null || true' EXIT
for ((r = 1; r <= ${AB_ROUNDS:-3}; r++)); do
  echo "new $r $(date +%T.%N): $(cd /tmp && python3 "$script" "${AB_REPEATS:-25}" ${AB_POINTS:-})"
  for tree in "$@"; do
    name=$(basename "$(realpath "$tree")")
    echo "$name $r $(date +%T.%N): $(cd /tmp && PYTHONPATH="${target[$name]}" python3 "$script" "${AB_REPEATS:-25}" ${AB_POINTS:-})"
  done
done | tee "$out/ab.txt"
# The same as one results file (bench_results/ keeps these): every run, and the medians over the rounds.
python3 - "$out/ab.txt" "$out/ab.json" "$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 2>/dev/null)" <<'PY'
import json, re, statistics, sys
runs = []
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) (\d+) (\S+): (\{.*\})\s*$", line)
    if m:
        runs.append({"build": m.group(1), "round": int(m.group(2)), "time": m.group(3),
                     "points": json.loads(m.group(4))["points"]})
medians = {}
for r in runs:
    for point, variants in r["points"].items():
        for variant, (median, _, _) in variants.items():
            medians.setdefault(r["build"], {}).setdefault(point, {}).setdefault(variant, []).append(median)
medians = {b: {p: {v: round(statistics.median(x), 3) for v, x in vs.items()} for p, vs in ps.items()}
           for b, ps in medians.items()}
meta = {"what": "tools/ab_commits.sh: the guard's points (median, p10, p90 us) per build, builds alternating",
        "gpu_uuid": sys.argv[3] or None, "format": "runs[].points[point][variant] = [median, p10, p90]"}
json.dump({"meta": meta, "medians_over_rounds": medians, "runs": runs}, open(sys.argv[2], "w"), indent=1)
for b, ps in medians.items():
    print(b, " | ".join(f"{p}: {vs['auto']:.2f} (c8 {vs['c8']:.2f}, ref {vs['eager_adds']:.2f})" for p, vs in ps.items()))
PY
