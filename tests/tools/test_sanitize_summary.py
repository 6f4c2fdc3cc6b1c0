"""tools/sanitize.sh's judgement of racecheck reports, without a GPU: a fake compute-sanitizer replays canned
logs. The persistent ring's bulk-copy reports are "the tool" only when racecheck also reported the correct ring
probe; every other report, or a failing test, stays a finding (docs/reliability.md section 4)."""
import os
import stat
import subprocess
from pathlib import Path

from helpers import ROOT

SCRIPT = ROOT / "tools" / "sanitize.sh"

RING_WRITE = ("attnres::detail::bulk_copy_to_shared(unsigned int, const void *, unsigned int, unsigned int)+0x70d0 "
              "in attn_res_persistent.cuh:126")
PER_TOKEN_WRITE = "void attnres::detail::attn_res_per_token_kernel<9, 2, true>(PerTokenParams)+0x100 in x.cuh:1"
READ = ("void attnres::detail::attn_res_persistent_kernel<(int)4, (bool)0>(attnres::detail::PersistentParams)"
        "+0x14e0 in attn_res_persistent.cuh:311 [624960 hazards]")


def race_log(write_sites, tail):
    lines = []
    for w in write_sites:
        lines += [f"========= Error: Race reported between Write access at {w}",
                  f"=========     and Read access at {READ}"]
    lines.append(f"========= RACECHECK SUMMARY: {len(write_sites)} hazards displayed ({len(write_sites)} errors, 0 warnings)")
    lines.append(tail)
    return "\n".join(lines) + "\n"


CLEAN = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
GTEST_OK = "[  PASSED  ] 11 tests.\n"
PYTEST_OK = "===== 79 passed, 844 deselected in 54.0s =====\n"

# The options of compute-sanitizer 2025.3's --help that the script looks for, --kernel-name with its keys.
HELP_WITH_FILTER = """  --print-limit arg (=100)              Stop printing messages after this number of errors.
  --require-cuda-init arg (=1)          Return an error if the application did not call a CUDA API.
  --kernel-name arg                     Filter the kernels to check, as key=value[,key=value...]; several
                                        --kernel-name options are additive. Keys: kernel_name (kne): the
                                        exact mangled name; kernel_substring (kns): a substring of the mangled
                                        name; regex: a regular expression found in the mangled name.
  --kernel-name-exclude arg             Filter the kernels not to check, same syntax.
"""
HELP_WITHOUT_FILTER = "  --print-limit arg (=100)\n  --require-cuda-init arg (=1)\n"

FAKE_CS = r"""#!/usr/bin/env bash
[[ $1 == --help ]] && { cat "$FAKE_DIR/help.txt"; exit 0; }
[[ $1 == --version ]] && { echo "fake compute-sanitizer"; exit 0; }
printf '%s\n' "$*" >>"$FAKE_DIR/calls.txt"
case "$*" in
  *"probe ordered"*) step=probe_ordered ;;
  *"probe racy"*) step=probe_racy
    [[ $* != *--kernel-name* && -f $FAKE_DIR/probe_racy_unfiltered.log ]] && step=probe_racy_unfiltered ;;
  *"-m pytest"*) step=pytest ;;
  *"/cpp/tests/test_cuda_backend "*) step=gtest_backend ;;
  *"/cpp/tests/test_moe_finalize "*) step=gtest_moe ;;
  *) echo "fake compute-sanitizer: unexpected $*"; exit 1 ;;
esac
cat "$FAKE_DIR/$step.log"
exit "$(cat "$FAKE_DIR/$step.rc")"
"""


# cuobjdump -symbols of binaries holding library kernels (one in an anonymous inner namespace), in the layout of
# cuobjdump 13.5 (first) and the STT_/STB_/STO_ one, with non-entry functions around them.
SYMBOLS = """
Fatbin elf code:
================
arch = sm_90
identifier = moe_finalize_kernel.cu

symbols:
FUNC          LOCAL   DEFAULT    ENTRY                                _ZN7attnres6detail55_GLOBAL__N__6f46393b_22_moe_finalize_kernel_cu_8ace654e23moe_finalize_single_ctaILi4ELi2EfEEvNS1_9MoeParamsE
OBJECT        WEAK    DEFAULT    -                                 U  .nv.reservedSmem.offset0
FUNC          WEAK    DEFAULT    -                                    $__internal_0_$__cuda_sm20_sqrt_rn_f32_slowpath

Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

symbols:
STT_SECTION      STB_LOCAL  .text._ZN7attnres6detail21moe_finalize_single_ctaENS0_9MoeParamsE
STT_FUNC         STB_GLOBAL STO_ENTRY      _ZN7attnres6detail24attn_res_per_token_kernelILi9ELi2ELb1EEEvNS0_14PerTokenParamsE
STT_FUNC         STB_LOCAL  STO_ENTRY      _ZN7attnres6detail48_GLOBAL__N__1e27ced5_19_all_reduce_kernel_cu_110ea77f19one_shot_all_reduceENS0_15AllReduceParamsE
STT_FUNC         STB_GLOBAL                _ZN7attnres6detail14warp_reduce_sumEf
"""


def run_sanitize(tmp_path: Path, logs: dict[str, tuple[str, int]], help_text: str = HELP_WITH_FILTER,
                 symbols: str | None = None, **env_over: str):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "help.txt").write_text(help_text)
    cs = fake / "compute-sanitizer"
    cs.write_text(FAKE_CS)
    cs.chmod(cs.stat().st_mode | stat.S_IXUSR)
    cuobjdump = fake / "cuobjdump"
    if symbols is not None:
        (fake / "symbols.txt").write_text(symbols)
        cuobjdump.write_text('#!/bin/sh\n[ "$1" = -symbols ] && cat "$FAKE_DIR/symbols.txt"\n')
        cuobjdump.chmod(0o755)
    for step, (text, rc) in logs.items():
        (fake / f"{step}.log").write_text(text)
        (fake / f"{step}.rc").write_text(str(rc))
    tests = tmp_path / "ctest" / "cpp" / "tests"
    tests.mkdir(parents=True)
    for name in ("test_cuda_backend", "test_moe_finalize"):
        (tests / name).write_text("#!/bin/sh\n")
        (tests / name).chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), SANITIZE_TOOLS="racecheck", FAKE_DIR=str(fake),
               COMPUTE_SANITIZER=str(cs), SANITIZE_CTEST_DIR=str(tmp_path / "ctest"), SANITIZE_PROBE="probe",
               SANITIZE_CUOBJDUMP=str(cuobjdump))
    env.pop("SANITIZE_KERNEL_FILTER", None)
    env.update(env_over)
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    summary = (tmp_path / "out" / "sanitize_summary.txt").read_text()
    return r.returncode, summary


def calls(tmp_path: Path) -> list[str]:
    """The command line of every sanitizer run, in order."""
    return (tmp_path / "fake" / "calls.txt").read_text().splitlines()


def row(summary: str, step: str, tool: str = "racecheck") -> str:
    return next(line for line in summary.splitlines() if line.startswith(tool) and f" {step} " in line)


def base_logs(**over):
    logs = {"probe_ordered": (race_log([RING_WRITE], ""), 99),  # this racecheck's limitation
            "probe_racy": (race_log([RING_WRITE], ""), 99),
            "gtest_backend": (race_log([RING_WRITE, RING_WRITE], GTEST_OK), 99),
            "gtest_moe": (CLEAN + "[  PASSED  ] 1 test.\n", 0),
            "pytest": (race_log([RING_WRITE], PYTEST_OK), 99)}
    logs.update(over)
    return logs


def test_ring_reports_are_the_tools_when_the_correct_probe_is_reported(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs())
    assert rc == 0, summary
    assert "ring only: the tool (probe)" in row(summary, "gtest_test_cuda_backend")
    assert "ring only: the tool (probe)" in row(summary, "pytest")
    assert "RESULT: clean" in summary


def test_a_report_outside_the_ring_is_a_finding(tmp_path):
    logs = base_logs(pytest=(race_log([RING_WRITE, PER_TOKEN_WRITE], PYTEST_OK), 99))
    rc, summary = run_sanitize(tmp_path, logs)
    assert rc == 1
    assert "FINDINGS" in row(summary, "pytest")
    assert "RESULT: FINDINGS" in summary


def test_ring_reports_are_findings_when_the_tool_orders_the_correct_probe(tmp_path):
    logs = base_logs(probe_ordered=(CLEAN, 0))
    rc, summary = run_sanitize(tmp_path, logs)
    assert rc == 1
    assert "clean (bulk copies ordered)" in row(summary, "probe_ordered")
    assert "FINDINGS" in row(summary, "gtest_test_cuda_backend")


def test_a_failing_test_is_never_excused(tmp_path):
    logs = base_logs(gtest_backend=(race_log([RING_WRITE], "[  FAILED  ] 1 test, listed below:\n"), 99))
    rc, summary = run_sanitize(tmp_path, logs)
    assert rc == 1
    assert "ring only" not in row(summary, "gtest_test_cuda_backend")


def test_a_racecheck_that_misses_the_racy_probe_fails(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs(probe_racy=(CLEAN, 0)))
    assert rc == 1
    assert "NOT REPORTED" in row(summary, "probe_racy")


# ------------------------------------------------------------------------------------------ the kernel filter
def test_every_racecheck_run_is_filtered_to_the_library_namespace(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs())
    assert rc == 0, summary
    assert "kernel filter (racecheck, synccheck): kns=7attnres6detail" in summary
    runs = calls(tmp_path)
    assert len(runs) == 5  # the two probes, the backend gtests, the finalize gtests, pytest
    for line in runs:
        assert "--kernel-name kns=7attnres6detail" in line, line
    # The mangled name of a kernel in attnres::detail (an anonymous inner namespace too) holds the substring.
    assert "7attnres6detail" in SYMBOLS.split("STO_ENTRY")[2] and "_GLOBAL__N_" in SYMBOLS.split("STO_ENTRY")[2]


FOCUSED = ("GpuSplitK.*:*AddDecodeT1*:*Add2TokenMajorT32*:*Add2SmallPadded*:*DeterministicWithAndWithoutPdlAndInAGraph*:"
           "GpuPersistent.SubnormalsKept")


def test_racecheck_leaves_out_the_persistent_graph_gtest(tmp_path):
    """Its ring reports fill racecheck's hazard buffer and the context then fails, in any process it runs in."""
    rc, summary = run_sanitize(tmp_path, base_logs())
    assert rc == 0, summary
    backend = [line for line in calls(tmp_path) if "/cpp/tests/test_cuda_backend " in line]
    assert len(backend) == 1, backend
    assert backend[0].endswith(f"--gtest_filter={FOCUSED}"), backend[0]


def test_synccheck_runs_the_persistent_graph_gtest(tmp_path):
    logs = base_logs(gtest_backend=(CLEAN + GTEST_OK, 0), pytest=(CLEAN + PYTEST_OK, 0))
    rc, summary = run_sanitize(tmp_path, logs, SANITIZE_TOOLS="synccheck")
    assert rc == 0, summary
    backend = [line for line in calls(tmp_path) if "/cpp/tests/test_cuda_backend " in line]
    assert len(backend) == 1, backend
    assert backend[0].endswith(f"--gtest_filter={FOCUSED}:GpuPersistent.GraphReplayEqualsEager"), backend[0]
    assert "clean" in row(summary, "gtest_test_cuda_backend", tool="synccheck")


def test_several_filters_become_several_options(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs(), SANITIZE_KERNEL_FILTER="kns=attn_res regex=detail.*reduce")
    assert rc == 0, summary
    for line in calls(tmp_path):
        assert "--kernel-name kns=attn_res --kernel-name regex=detail.*reduce" in line, line


def test_without_the_option_nothing_is_filtered(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs(), help_text=HELP_WITHOUT_FILTER)
    assert rc == 0, summary
    assert "kernel filter (racecheck, synccheck): none" in summary
    assert not any("--kernel-name" in line for line in calls(tmp_path))


def test_a_racy_probe_the_filter_misses_fails_the_run(tmp_path):
    """Under the filter the racy probe is clean (the filter selected no kernel); unfiltered it is reported: the
    filter is what missed, and the run must fail although every step is 'clean'."""
    logs = base_logs(probe_racy=(CLEAN, 0), probe_racy_unfiltered=(race_log([RING_WRITE], ""), 99))
    rc, summary = run_sanitize(tmp_path, logs)
    assert rc == 1, summary
    assert "NOT REPORTED under the filter" in row(summary, "probe_racy")
    assert "the filter missed the probe kernel" in row(summary, "probe_racy_unfiltered")
    assert "RESULT: TEST FAILURES" in summary
    assert "--kernel-name" not in calls(tmp_path)[2]  # the rerun is unfiltered


def test_a_racecheck_that_misses_the_probe_either_way_fails(tmp_path):
    logs = base_logs(probe_racy=(CLEAN, 0), probe_racy_unfiltered=(CLEAN, 0))
    rc, summary = run_sanitize(tmp_path, logs)
    assert rc == 1
    assert "NOT REPORTED: racecheck missed it" in row(summary, "probe_racy_unfiltered")


def test_static_check_counts_the_library_kernels_the_filter_matches(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs(), symbols=SYMBOLS)
    assert rc == 0, summary
    line = row(summary, "static check", tool="filter")
    assert " matches " in line and "kns=7attnres6detail: 3 of 3 entries" in line, line


def test_a_filter_that_matches_no_kernel_fails_the_run(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs(), symbols=SYMBOLS,
                               SANITIZE_KERNEL_FILTER="kns=7attnres6detail kne=attn_res_per_token_kernel")
    assert rc == 1, summary
    line = row(summary, "static check", tool="filter")
    assert "MATCHES NO KERNEL: kne=attn_res_per_token_kernel" in line, line  # kne wants the whole mangled name
    assert "kns=7attnres6detail: 3 of 3 entries" in line


def test_regex_filter_is_a_search_in_the_mangled_name(tmp_path):
    rc, summary = run_sanitize(tmp_path, base_logs(), symbols=SYMBOLS, SANITIZE_KERNEL_FILTER="regex=one_shot_all_r.duce")
    assert rc == 0, summary
    assert "regex=one_shot_all_r.duce: 1 of 3 entries" in row(summary, "static check", tool="filter")


def _pytest_calls(tmp_path: Path) -> list[str]:
    return [line for line in calls(tmp_path) if "-m pytest" in line]


def test_initcheck_runs_the_in_process_world_with_the_caching_allocator(tmp_path):
    """Under initcheck a fresh cudaMalloc between two ranks' launches waited for the device, so the uncached step
    would time the world's exchange out: its cases go to the graph step's process (caching allocator)."""
    ok = "========= ERROR SUMMARY: 0 errors\n"
    logs = base_logs(gtest_backend=(ok + GTEST_OK, 0), gtest_moe=(ok + "[  PASSED  ] 1 test.\n", 0),
                     pytest=(ok + PYTEST_OK, 0))
    run_sanitize(tmp_path, logs, SANITIZE_TOOLS="initcheck")
    uncached, cached = _pytest_calls(tmp_path)
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in uncached and "PYTORCH_NO_CUDA_MEMORY_CACHING" not in cached
    assert "contract_bitwise" not in uncached and "test_all_reduce and" not in uncached
    assert "contract_bitwise" in cached and "pdl_chain_with_plain_ops" in cached and "rank_that_never_arrives" in cached
    assert "test_ops_oracle" in uncached and "test_fp8" in uncached  # the rest of the main subset stays uncached
    summary = (tmp_path / "out" / "sanitize_summary.txt").read_text()
    assert "initcheck: the in-process all-reduce world runs in the graph step's process" in summary


def test_memcheck_keeps_the_in_process_world_uncached(tmp_path):
    ok = "========= ERROR SUMMARY: 0 errors\n"
    logs = base_logs(gtest_backend=(ok + GTEST_OK, 0), gtest_moe=(ok + "[  PASSED  ] 1 test.\n", 0),
                     pytest=(ok + PYTEST_OK, 0))
    run_sanitize(tmp_path, logs, SANITIZE_TOOLS="memcheck", SANITIZE_STRESS_CALLS="0")
    uncached, cached = _pytest_calls(tmp_path)
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in uncached and "contract_bitwise" in uncached
    assert "contract_bitwise" not in cached
