#!/usr/bin/env bash
# compute-sanitizer over the GPU tests (docs/reliability.md section 4), on the H200, from the repository root,
# after tools/gpu_check.sh has installed the CUDA build (and, for the C++ part, built build/ctest):
#
#   tools/sanitize.sh                      summary: $OUT/sanitize_summary.txt, logs: $OUT/sanitize/*.log
#
# For each tool (memcheck, racecheck, initcheck, synccheck) it runs
#   (a) the GPU GoogleTest suites: build/ctest/cpp/tests/test_cuda_backend (its Gpu* suites) and
#       test_moe_finalize (MoeFinalizeGpu.*);
#   (b) a focused pytest subset of the CUDA cases: the kernels against the oracle (decode, odd H, T > 32,
#       H = 16384, N = 1, every kernel), the bitwise properties, MoE finalize, the decode chain with the fold
#       (small config), and — in a process of its own, see below — CUDA graphs and PDL chaining;
#   (c) memcheck only: a short random-shape stress run (python -m stress calls, no graphs);
#   (d) racecheck only: tools/racecheck_probe.cu, the persistent ring's protocol in one block, correct and racy.
# each as `compute-sanitizer --tool X --target-processes all --error-exitcode 99 ...`.
#
# Allocations. PyTorch's caching allocator hands out sub-blocks of large cudaMalloc segments: memcheck cannot
# see an access that overruns a tensor into its neighbour in the same segment, and initcheck sees memory that
# an earlier tensor wrote as initialized. So the non-graph subsets run with PYTORCH_NO_CUDA_MEMORY_CACHING=1
# (every tensor its own cudaMalloc, fresh and uninitialized). CUDA graph capture needs the caching allocator
# (the uncached one breaks capture), so the graph/PDL tests run in a second process with caching on.
# memcheck and initcheck instrument every kernel (PyTorch's too: a torch kernel reading an output element our
# kernel never wrote is a finding of ours, and writes by uninstrumented kernels would look uninitialized to
# initcheck); initcheck runs with default options. racecheck and synccheck instrument only the
# library's kernels: `--kernel-name kns=7attnres6detail`, a substring of the mangled name of every kernel in
# namespace attnres::detail (_ZN7attnres6detail..., anonymous inner namespaces included), whenever this
# compute-sanitizer lists --kernel-name in its --help (PyTorch's kernels are slow under racecheck and not ours to
# judge). A filter that matches no kernel must not pass as clean, so it is checked twice: statically, against the
# kernel entries cuobjdump lists in the built binaries (no match: a failure), and at run time, where the racy
# probe of (d) (its kernel is in attnres::detail too) runs under the same filter and must be reported (when it is
# not, it runs once more unfiltered to tell a filter that misses from a racecheck that misses). The summary
# breaks every tool's findings down by kernel name.
#
# Environment (all optional):
#   OUT                          output folder (default ./gpu_out)
#   SANITIZE_TOOLS               default "memcheck racecheck initcheck synccheck"
#   SANITIZE_SIZE_<TOOL>         small | medium | large: how many pytest cases the tool runs (defaults: memcheck
#                                medium; racecheck, synccheck, initcheck small); SANITIZE_SIZE sets all four
#   SANITIZE_STRESS_CALLS        random calls of (c) (default 100: 300 did not finish in 123 s; 0 skips)
#   SANITIZE_STEP_TIMEOUT        seconds per sanitizer process (default 240: racecheck's pytest step)
#   SANITIZE_BUDGET_S            overall seconds; steps that would start later are reported as not run (default 470)
#   SANITIZE_K_MAIN, SANITIZE_K_GRAPH   override the pytest -k expressions of (b)
#   SANITIZE_GTEST_FILTER (memcheck), SANITIZE_GTEST_FILTER_RACECHECK (racecheck, synccheck, initcheck),
#   SANITIZE_GTEST_FILTER_MOE   override (a)'s filters
#   SANITIZE_KERNEL_FILTER       racecheck/synccheck --kernel-name values, several separated by spaces (additive:
#                                one --kernel-name each), e.g. "kns=attn_res_persistent regex=moe_finalize";
#                                keys kne/kernel_name (exact mangled name), kns/kernel_substring (substring of the
#                                mangled name), regex (found in the mangled name); "none": instrument every kernel.
#                                It must match the probe's kernel (attnres::detail::racecheck_probe::ring_probe)
#                                too, or the run fails at (d)
#   SANITIZE_CUOBJDUMP           cuobjdump for the static filter check (default: on PATH, else /usr/local/cuda/bin)
#   SANITIZE_CTEST_DIR           default build/ctest
#   COMPUTE_SANITIZER            the executable (default: compute-sanitizer on PATH, else /usr/local/cuda/bin)
#   SANITIZE_PROBE               a built racecheck probe (default: build tools/racecheck_probe.cu with nvcc)
# racecheck reports whose every write side is the persistent ring's bulk copy are listed as "ring only: the tool
# (probe)", not as findings, once the correct probe of (d) (run first) was reported too: racecheck does not see
# a bulk copy's completion through the mbarrier, so such a report carries no information (docs/reliability.md
# section 4). Any other report, or any ring report while the probe is clean, stays a finding.
# Exit: 0 clean; 1 a finding (an error reported by a tool) or a failing test; 3 clean so far but some step did
# not run or did not finish (budget, timeout, missing binary).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}
LOGS=$OUT/sanitize
mkdir -p "$LOGS"
SUMMARY=$OUT/sanitize_summary.txt
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
size_of() {  # $1 tool
  local var=SANITIZE_SIZE_${1^^} def=small
  [[ $1 == memcheck ]] && def=medium
  echo "${!var:-${SANITIZE_SIZE:-$def}}"
}
STRESS_CALLS=${SANITIZE_STRESS_CALLS:-100}
STEP_TIMEOUT=${SANITIZE_STEP_TIMEOUT:-240}
BUDGET=${SANITIZE_BUDGET_S:-470}
CTEST_DIR=${SANITIZE_CTEST_DIR:-build/ctest}
START=$(date +%s)
export PYTHONUNBUFFERED=1

CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [[ ! -x $CS ]]; then
  echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee "$SUMMARY"
  exit 3
fi
HELP=$("$CS" --help 2>&1 || true)
has_opt() { grep -q -- "$1" <<<"$HELP"; }

# Options this compute-sanitizer knows (checked against its --help, so an older one degrades, not fails).
COMMON=(--target-processes all --error-exitcode 99)
has_opt "--print-limit" && COMMON+=(--print-limit 200)
has_opt "--require-cuda-init" && COMMON+=(--require-cuda-init no)
# --kernel-name takes key=value filters (kne: exact mangled name, kns: substring of it, regex: found in it);
# every library kernel is in namespace attnres::detail, so its mangled name holds "7attnres6detail".
if [[ -n ${SANITIZE_KERNEL_FILTER:-} ]]; then
  KFILTER=$SANITIZE_KERNEL_FILTER
elif has_opt "--kernel-name"; then
  KFILTER="kns=7attnres6detail"
else
  KFILTER=none
fi
NO_FILTER=0  # set around a step that must run unfiltered (the diagnostic rerun of the racy probe)
tool_opts() {  # $1 tool -> TOOL_OPTS (racecheck and synccheck watch only the library's kernels)
  TOOL_OPTS=()
  local f filters
  case $1 in
    memcheck) has_opt "--padding" && TOOL_OPTS=(--padding 32) ;;
    # initcheck: no options. `--track-unused-memory no` made compute-sanitizer 2025.3 take "no" for the target
    # program (every initcheck step failed at once, 2026-11-30): unused-memory tracking is off by default.
    racecheck | synccheck)
      if [[ $KFILTER != none && $NO_FILTER == 0 ]]; then
        read -ra filters <<<"$KFILTER"  # split on spaces, never globbed (a regex holds * and ?)
        for f in "${filters[@]}"; do TOOL_OPTS+=(--kernel-name "$f"); done
      fi ;;
  esac
  return 0
}

# ---------------------------------------------------------------------------------------- the subsets
# pytest -k expressions over node names and parameter ids (module names are keywords too).
# The one-shot all-reduce, every size: the in-process world of ranks on one GPU (each rank's kernel on its own
# stream) — the contract at W = 2, 4, 8, the fused sites, the fused MoE finalize and its CUDA-only rejections, a
# PDL chain with the plain ops — and the fault injection (a rank that never arrives, in a child process of
# its own, which --target-processes all instruments too). Graph replay and the W processes exchanging IPC
# handles are in the graph subsets (the caching allocator; the IPC world only at size large: W processes
# under a sanitizer, time-sliced on one GPU, each spin wait progressing only at a context switch).
K_ALLREDUCE="(test_all_reduce and ((cuda and (contract_bitwise or fused_site_equals or moe_finalize_all_reduce)) or pdl_chain_with_plain_ops or rank_that_never_arrives))"
# initcheck runs the in-process world with the caching allocator (in the graph step's process), not uncached:
# the world's ranks exchange only while every rank's kernel runs, so nothing between one rank's launch and the
# next may wait for the device (tp/communicator.py, InProcessWorld), and under initcheck with
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 something did (an allocation between the ranks' launches, the one difference
# from the passing runs): rank 0's exchange timed out (10 s) and its outputs stayed unwritten in every in-process
# case (10 failed, 3424d44, 2026-12-01), while the same contract case passed clean under initcheck with the
# caching allocator and under memcheck uncached (b1e3708; bench_results/h200_513b85e_sanitize_initcheck.txt).
WORLD_CACHED_TOOLS=" initcheck "

k_main() {  # $1 size, $2 tool
  local oracle moe chain
  case $1 in
    small)
      oracle="T1-N9-H7168 or T33-N1-H4096 or T2-N2-H200"
      moe="cuda_matches_cpu or T1-k32-D16384 or remote_routes"
      chain="fold_is_bitwise_invisible and cuda-1-snapshot_major" ;;
    large)
      oracle="T"
      moe="cuda"
      chain="fold_is_bitwise_invisible or materialize_first" ;;
    *)
      oracle="T1-N9-H7168 or T2-N2-H200 or T33-N9-H7168 or T3-N16-H16384 or T33-N1-H4096 or T5-N4-H2304 or T3-N11-H8"
      moe="cuda_matches_cpu or T1-k32-D16384 or T4-k32-D3584 or T33-k8-D7168 or T8-k16-D8 or remote_routes or all_remote or out_of_range"
      chain="fold_is_bitwise_invisible and snapshot_major and not kimi_block" ;;
  esac
  # The persistent kernel (its shared-memory ring is what racecheck and synccheck are for): the subnormal case
  # and the decline path always, the oracle grid's T = 33 and T = 300 cases from medium up.
  local persistent="subnormal_sums or add2_is_declined"
  [[ $1 != small ]] && persistent="$persistent or (against_the_oracle and (T33 or T300))"
  local allreduce=" or $K_ALLREDUCE"
  [[ $WORLD_CACHED_TOOLS == *" ${2:-} "* ]] && allreduce=""
  local fp8="(test_fp8 and ((matches_quantized_bf16_output and cuda) or split_k_groups_across_blocks or persistent_every_vector_bucket))"
  echo "not graph and not capture and ((test_ops_oracle and ($oracle)) or test_bitwise or (test_moe_finalize and ($moe)) or (test_chain and ($chain)) or (test_persistent and ($persistent))$allreduce or $fp8)"
}
k_graph() {  # $1 size, $2 tool
  [[ $WORLD_CACHED_TOOLS == *" ${2:-} "* ]] && echo -n "$K_ALLREDUCE or "
  case $1 in
    small) echo "(test_cuda_graphs_pdl and (1-5-7168 or newest_bank_row and 1-7168)) or (test_moe_finalize and graph) or (test_pdl_release and (split_k-per_token or persistent-finalize+per_token))" ;;
    large) echo "test_cuda_graphs_pdl or (test_moe_finalize and graph) or (test_stress and cuda) or (test_all_reduce and (graph_replay or processes_on_one_gpu))" ;;
    *) echo "(test_cuda_graphs_pdl and (1-5-7168 or 8-3-2304 or newest_bank_row or first_call_inside or callers_stream)) or (test_moe_finalize and graph) or (test_stress and calls_on_cuda_streams) or (test_all_reduce and graph_replay)" ;;
  esac
}
MAIN_FILES=(tests/ops/test_ops_oracle.py tests/ops/test_bitwise.py tests/ops/test_moe_finalize.py tests/model/test_chain.py
  tests/kernels/test_persistent.py tests/tp/test_all_reduce.py tests/ops/test_fp8.py)
GRAPH_FILES=(tests/kernels/test_cuda_graphs_pdl.py tests/ops/test_moe_finalize.py tests/tools/test_stress.py
  tests/kernels/test_pdl_release.py tests/tp/test_all_reduce.py)
GTEST_ALL=${SANITIZE_GTEST_FILTER:-*Gpu*}
# racecheck, synccheck and initcheck run a focused gtest set (every kernel family and mode: decode add, token-major
# add2, the small padded case with its one-block cluster, PDL/graph determinism, the persistent ring): the full
# *Gpu* set under synccheck alone took 100 s of the 600 s a device call may run (2026-11-30).
GTEST_RACE=${SANITIZE_GTEST_FILTER_RACECHECK:-GpuSplitK.*:*AddDecodeT1*:*Add2TokenMajorT32*:*Add2SmallPadded*:*DeterministicWithAndWithoutPdlAndInAGraph*:GpuPersistent.SubnormalsKept:GpuPersistent.GraphReplayEqualsEager}
GTEST_MOE=${SANITIZE_GTEST_FILTER_MOE:-MoeFinalizeGpu.*}
# racecheck leaves this test of the focused set out (synccheck and initcheck run it): its graph replays make
# racecheck report the persistent ring's bulk copies until its hazard buffer is full ("Maximum number of hazards
# reached"), after which the context fails ("unspecified launch failure"). In the gtest process it failed the nine
# gtests after it (3ea960b: 1.29 M reports); in a process of its own it still failed itself (7664bd7, 2026-12-01,
# passing in 2 s without the tool): a run that ends in the tool's own failure can show nothing. The ring under
# racecheck is the persistent cases of the pytest step and GpuPersistent.SubnormalsKept.
RACE_SKIP=GpuPersistent.GraphReplayEqualsEager

# ---------------------------------------------------------------------------------------- running a step
declare -a ROWS=()
RING_TOOL_LIMIT=0  # set when this racecheck reports the correct ring probe (section (d))
ring_reports=0
findings=0
incomplete=0
failures=0

# Sums every "ERROR SUMMARY: n errors" (one per process) and racecheck's hazard counts; lists the kernels
# named in the reports.
# The fourth field: 1 when the log holds racecheck reports and every one of them has the persistent ring's bulk
# copy (bulk_copy_to_shared) as its write side, the reports racecheck also makes on the correct ring of
# tools/racecheck_probe.cu (section (d)); 0 otherwise.
parse_log() {  # $1 log -> "errors kernels tests ring_only"
  python3 - "$1" <<'PY'
import re, sys, collections
text = open(sys.argv[1], errors="replace").read()
# (not "ERROR SUMMARY: n errors were not printed", the print limit's second line about the same errors)
errors = sum(int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, re.M))
errors += sum(int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text))
kernels = collections.Counter()
for line in text.splitlines():
    m = re.match(r"=+\s+(?:at|in) (?:0x[0-9a-f]+ in )?(.+)$", line)
    if m and ("(" in m.group(1) or "<" in m.group(1)):
        name = re.sub(r"\(.*", "", m.group(1)).strip()
        kernels[name[-80:]] += 1
tests = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected)[^\n]*?)(?: in [\d.]+s)?\s*=*$", text, re.M)
tail = tests[-1] if tests else ""
gt = re.findall(r"\[  (PASSED|FAILED)  \] (\d+) test", text)
if gt:
    tail = ", ".join(f"{n} {s.lower()}" for s, n in gt)
top = "; ".join(f"{k} x{v}" for k, v in kernels.most_common(5))
races = re.findall(r"Error: Race reported between Write access at (.*)$", text, re.M)
other_errors = [e for e in re.findall(r"=+ Error: (.*)$", text, re.M) if not e.startswith("Race reported")]
ring_only = int(bool(races) and not other_errors and all("bulk_copy_to_shared" in w for w in races))
print(f"{errors}\t{top or '-'}\t{tail or '-'}\t{ring_only}")
PY
}

run_step() {  # $1 tool, $2 step name, rest: the command (run under the sanitizer)
  local tool=$1 name=$2
  shift 2
  local log=$LOGS/${tool}_${name}.log
  local now=$(( $(date +%s) - START ))
  if (( now + 20 > BUDGET )); then
    ROWS+=("$tool|$name|not run: budget of ${BUDGET}s spent|-|-|-")
    incomplete=1
    return
  fi
  local left=$(( BUDGET - now ))
  local limit=$(( STEP_TIMEOUT < left ? STEP_TIMEOUT : left ))
  local t0=$(date +%s)
  echo "== $tool / $name (limit ${limit}s)"
  tool_opts "$tool"
  timeout --signal=INT --kill-after=15 "$limit" "$CS" --tool "$tool" "${COMMON[@]}" "${TOOL_OPTS[@]}" "$@" \
    >"$log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local parsed errors kernels tests ring_only status
  parsed=$(parse_log "$log")
  IFS=$'\t' read -r errors kernels tests ring_only <<<"$parsed"
  if (( rc == 124 || rc == 130 || rc == 137 )); then
    status="TIMEOUT after ${dt}s"; incomplete=1
  elif [[ $tool == racecheck && $name != probe_* && $ring_only == 1 && $RING_TOOL_LIMIT == 1 \
          && $tests != *failed* && $tests != *FAILED* ]] && (( rc == 99 || rc == 0 )); then
    # Every report is the ring's bulk copy, which this racecheck also reports on the correct probe: not a
    # finding it can make. The tests themselves passed (rc 99 = only the sanitizer's error exit).
    status="ring only: the tool (probe)"; ring_reports=1
    ROWS+=("$tool|$name|$status|$errors|${dt}s|$tests|$kernels")
    echo "   $status, errors $errors, ${dt}s, $tests"
    return
  elif (( rc == 99 || errors > 0 )); then
    status="FINDINGS"; findings=1
  elif (( rc == 5 )) && [[ $* == *pytest* ]]; then
    status="no test selected"; incomplete=1
  elif (( rc != 0 )); then
    status="FAILED (rc $rc)"; failures=1
  else
    status="clean"
  fi
  (( errors > 0 )) && findings=1
  ROWS+=("$tool|$name|$status|$errors|${dt}s|$tests|$kernels")
  echo "   $status, errors $errors, ${dt}s, $tests"
}

label_last() {  # pairs of (from, to): relabel the status of the last summary row
  while (( $# >= 2 )); do ROWS[-1]=${ROWS[-1]/"$1"/"$2"}; shift 2; done
}

build_probe() {  # -> path of tools/racecheck_probe.cu built for sm_90 (nothing when nvcc is missing or fails)
  local nvcc out=${TMPDIR:-/tmp}/attnres_racecheck_probe
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [[ -x $nvcc ]] || return 1
  "$nvcc" -arch=sm_90 -lineinfo -std=c++17 -I cpp/src -I cpp/include tools/racecheck_probe.cu -o "$out" \
    >>"$LOGS/build.log" 2>&1 || return 1
  echo "$out"
}

gtest_bin() {  # $1 binary name -> path, building it if the ctest tree exists but lacks it
  local bin=$CTEST_DIR/cpp/tests/$1
  if [[ ! -x $bin && -d $CTEST_DIR ]]; then
    cmake --build "$CTEST_DIR" --target "$1" >>"$LOGS/build.log" 2>&1 || true
  fi
  [[ -x $bin ]] && echo "$bin"
}

# The kernel entries of the built library (cuobjdump -symbols over the gtest binaries and the extension), and
# which of them each filter of KFILTER matches, by compute-sanitizer's rules for the keys.
filter_check() {  # -> ROWS entry; a filter that matches no entry is a failure
  local cuobjdump=${SANITIZE_CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
  local bins=() b so verdict
  for b in test_cuda_backend test_moe_finalize; do
    [[ -f $CTEST_DIR/cpp/tests/$b ]] && bins+=("$CTEST_DIR/cpp/tests/$b")
  done
  so=$(python3 -c "import attnres._C as c; print(c.__file__)" 2>/dev/null) && [[ -f $so ]] && bins+=("$so")
  if [[ ! -x $cuobjdump ]]; then
    verdict=$'unchecked\tno cuobjdump'
  else
    verdict=$(for b in "${bins[@]}"; do "$cuobjdump" -symbols "$b" 2>/dev/null; done | python3 -c '
import re, sys
filters = sys.argv[1].split()
# A kernel entry: "FUNC LOCAL DEFAULT ENTRY name" (cuobjdump 13.5) or "STT_FUNC STB_GLOBAL STO_ENTRY name".
names = sorted({f[-1] for f in map(str.split, sys.stdin)
                if f and f[0] in ("FUNC", "STT_FUNC") and {"ENTRY", "STO_ENTRY"} & set(f[1:-1])})
def matches(f, name):
    for part in f.split(","):
        key, _, value = part.partition("=")
        if key in ("kne", "kernel_name"):
            ok = name == value
        elif key in ("kns", "kernel_substring"):
            ok = value in name
        elif key == "regex":
            ok = re.search(value, name) is not None
        else:
            raise KeyError(key)
        if not ok:
            return False
    return True
if not names:
    print("unchecked	cuobjdump listed no kernel entry"); sys.exit()
counts = []
try:
    for f in filters:
        counts.append((f, sum(matches(f, n) for n in names)))
except KeyError as e:
    print(f"unchecked	key {e.args[0]!r} unknown here"); sys.exit()
bad = [f for f, c in counts if c == 0]
detail = ", ".join(f"{f}: {c} of {len(names)} entries" for f, c in counts)
print(("MATCHES NO KERNEL: " + " ".join(bad)) if bad else "matches", detail, sep="	")
' "$KFILTER")
  fi
  local status detail
  IFS=$'\t' read -r status detail <<<"$verdict"
  [[ $status == MATCHES* ]] && failures=1
  ROWS+=("filter|static check|$status|-|-|$detail")
}

# ---------------------------------------------------------------------------------------- the runs
echo "compute-sanitizer: $("$CS" --version 2>&1 | tail -1); kernel filter: $KFILTER"
[[ $KFILTER != none && " $TOOLS " =~ \ (racecheck|synccheck)\  ]] && filter_check
for tool in $TOOLS; do
  size=$(size_of "$tool")
  gfilter=$GTEST_ALL
  [[ $tool != memcheck ]] && gfilter=$GTEST_RACE

  # (d) racecheck only, first: does this racecheck order a bulk copy before the reads that wait for it? The probe
  # (tools/racecheck_probe.cu) runs the persistent kernel's ring protocol reduced to one block: "ordered" is
  # correct code (a report there is the tool's), "racy" reads before the wait (racecheck must report it). Both
  # run under the kernel filter of the other steps: the racy probe's report is also the proof that the filter
  # selects a kernel of attnres::detail. When it is not reported, an unfiltered rerun tells the two causes apart.
  if [[ $tool == racecheck ]] && probe=${SANITIZE_PROBE:-$(build_probe)}; then
    saved=$findings  # no probe's report is a finding of the library's
    run_step racecheck probe_ordered "$probe" ordered
    [[ ${ROWS[-1]} == *"|FINDINGS|"* ]] && RING_TOOL_LIMIT=1
    label_last "|FINDINGS|" "|FINDINGS: on correct code (the tool)|" "|clean|" "|clean (bulk copies ordered)|"
    run_step racecheck probe_racy "$probe" racy
    if [[ ${ROWS[-1]} == *"|FINDINGS|"* ]]; then
      label_last "|FINDINGS|" "|reported, as it must be|"
    elif [[ $KFILTER == none ]]; then
      label_last "|clean|" "|NOT REPORTED: racecheck missed it|"
      failures=1
    else
      label_last "|clean|" "|NOT REPORTED under the filter|"
      failures=1
      NO_FILTER=1
      run_step racecheck probe_racy_unfiltered "$probe" racy
      NO_FILTER=0
      if [[ ${ROWS[-1]} == *"|FINDINGS|"* ]]; then
        label_last "|FINDINGS|" "|reported: the filter missed the probe kernel|"
      else
        label_last "|clean|" "|NOT REPORTED: racecheck missed it|"
      fi
    fi
    findings=$saved
  fi

  # (a) GoogleTest GPU suites
  for suite in test_cuda_backend test_moe_finalize; do
    bin=$(gtest_bin $suite)
    if [[ -z $bin ]]; then
      ROWS+=("$tool|gtest $suite|not run: $CTEST_DIR/cpp/tests/$suite missing (run tools/gpu_check.sh test first)|-|-|-")
      incomplete=1
      continue
    fi
    filter=$gfilter
    [[ $suite == test_moe_finalize ]] && filter=$GTEST_MOE
    # Leaks are judged on our own binaries only: a Python process exits without freeing PyTorch's device and
    # pinned allocations, which --leak-check reports by the thousand (2026-11-30: 4,664 "errors", all leaks).
    leak=()
    [[ $tool == memcheck ]] && leak=(--leak-check full)
    [[ $tool == racecheck && $suite == test_cuda_backend ]] && filter=${filter/:$RACE_SKIP/}
    run_step "$tool" "gtest_$suite" "${leak[@]}" "$bin" --gtest_filter="$filter"
  done

  # (b) pytest: the non-graph subset (uncached allocations where the tool reads allocations), then graphs
  kmain=${SANITIZE_K_MAIN:-$(k_main "$size" "$tool")}
  kgraph=${SANITIZE_K_GRAPH:-$(k_graph "$size" "$tool")}
  pytest_cmd=(python3 -m pytest -q -p no:cacheprovider -m gpu)
  if [[ $tool == memcheck || $tool == initcheck ]]; then
    run_step "$tool" pytest_uncached env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${pytest_cmd[@]}" -k "$kmain" "${MAIN_FILES[@]}"
    run_step "$tool" pytest_graphs "${pytest_cmd[@]}" -k "$kgraph" "${GRAPH_FILES[@]}"
  else
    # Shared memory and barriers do not depend on the allocator: one process, graphs included.
    run_step "$tool" pytest "${pytest_cmd[@]}" -k "($kmain) or ($kgraph)" \
      $(printf '%s\n' "${MAIN_FILES[@]}" "${GRAPH_FILES[@]}" | sort -u)
  fi

  # (c) random shapes and layouts (memcheck: out-of-bounds accesses are what random strides find)
  if [[ $tool == memcheck && $STRESS_CALLS -gt 0 ]]; then
    run_step "$tool" stress_calls env PYTORCH_NO_CUDA_MEMORY_CACHING=1 python3 -m stress calls \
      --count "$STRESS_CALLS" --device cuda --streams 2 --graph-every 0 --quiet --seed 5
  fi
done

# ---------------------------------------------------------------------------------------- summary
{
  commit=${ATTNRES_COMMIT:-unknown}
  [[ $commit == unknown ]] && commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "tools/sanitize.sh at $commit, $(date -u +%FT%TZ)"
  echo "compute-sanitizer: $("$CS" --version 2>&1 | tail -1)"
  echo "options: ${COMMON[*]}; kernel filter (racecheck, synccheck): $KFILTER (--kernel-name each); memcheck, initcheck: every kernel"
  echo "sizes: $(for t in $TOOLS; do printf '%s %s; ' "$t" "$(size_of "$t")"; done)stress calls under memcheck: $STRESS_CALLS; wall $(( $(date +%s) - START ))s"
  echo
  printf '%-10s %-24s %-28s %-7s %-6s %s\n' tool step status errors time "tests / kernels named in reports"
  for row in "${ROWS[@]}"; do
    IFS='|' read -r tool name status errors dt tests kernels <<<"$row"
    printf '%-10s %-24s %-28s %-7s %-6s %s\n' "$tool" "$name" "$status" "$errors" "$dt" "$tests"
    [[ -n ${kernels:-} && $kernels != - ]] && printf '%-78s kernels: %s\n' "" "$kernels"
  done
  echo
  for size in $(for t in $TOOLS; do size_of "$t"; echo; done | sort -u); do
    echo "pytest -k (main, $size): ${SANITIZE_K_MAIN:-$(k_main "$size")}"
    echo "pytest -k (graphs, $size): ${SANITIZE_K_GRAPH:-$(k_graph "$size")}"
  done
  for t in $TOOLS; do
    [[ $WORLD_CACHED_TOOLS == *" $t "* ]] && echo "$t: the in-process all-reduce world runs in the graph step's process (caching allocator), not uncached"
  done
  echo "gtest filters: memcheck $GTEST_ALL; synccheck, initcheck $GTEST_RACE; racecheck the same without $RACE_SKIP; moe: $GTEST_MOE"
  if (( ring_reports && !findings )); then
    echo "racecheck: the persistent ring's bulk-copy reports only, which it makes on the correct probe too (docs/reliability.md section 4)"
  fi
  if (( findings )); then echo "RESULT: FINDINGS (see $LOGS)";
  elif (( failures )); then echo "RESULT: TEST FAILURES under the sanitizer (see $LOGS)";
  elif (( incomplete )); then echo "RESULT: no finding, but not every step ran to the end";
  else echo "RESULT: clean"; fi
} | tee "$SUMMARY"
(( findings || failures )) && exit 1
(( incomplete )) && exit 3
exit 0
