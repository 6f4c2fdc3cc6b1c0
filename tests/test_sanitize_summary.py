"""tools/sanitize.sh's judgement of racecheck reports, without a GPU: a fake compute-sanitizer replays canned
logs. The persistent ring's bulk-copy reports are "the tool" only when racecheck also reported the correct ring
probe; every other report, or a failing test, stays a finding (docs/reliability.md section 4)."""
import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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

FAKE_CS = r"""#!/usr/bin/env bash
[[ $1 == --help ]] && { echo "--print-limit --require-cuda-init"; exit 0; }
[[ $1 == --version ]] && { echo "fake compute-sanitizer"; exit 0; }
case "$*" in
  *"probe ordered"*) step=probe_ordered ;;
  *"probe racy"*) step=probe_racy ;;
  *"-m pytest"*) step=pytest ;;
  *"/cpp/tests/test_cuda_backend "*) step=gtest_backend ;;
  *"/cpp/tests/test_moe_finalize "*) step=gtest_moe ;;
  *) echo "fake compute-sanitizer: unexpected $*"; exit 1 ;;
esac
cat "$FAKE_DIR/$step.log"
exit "$(cat "$FAKE_DIR/$step.rc")"
"""


def run_sanitize(tmp_path: Path, logs: dict[str, tuple[str, int]]):
    fake = tmp_path / "fake"
    fake.mkdir()
    cs = fake / "compute-sanitizer"
    cs.write_text(FAKE_CS)
    cs.chmod(cs.stat().st_mode | stat.S_IXUSR)
    for step, (text, rc) in logs.items():
        (fake / f"{step}.log").write_text(text)
        (fake / f"{step}.rc").write_text(str(rc))
    tests = tmp_path / "ctest" / "cpp" / "tests"
    tests.mkdir(parents=True)
    for name in ("test_cuda_backend", "test_moe_finalize"):
        (tests / name).write_text("#!/bin/sh\n")
        (tests / name).chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), SANITIZE_TOOLS="racecheck", FAKE_DIR=str(fake),
               COMPUTE_SANITIZER=str(cs), SANITIZE_CTEST_DIR=str(tmp_path / "ctest"), SANITIZE_PROBE="probe")
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    summary = (tmp_path / "out" / "sanitize_summary.txt").read_text()
    return r.returncode, summary


def row(summary: str, step: str) -> str:
    return next(line for line in summary.splitlines() if line.startswith("racecheck") and f" {step} " in line)


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
