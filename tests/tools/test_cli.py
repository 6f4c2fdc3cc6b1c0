"""The command lines: `python -m attnres --help` lists every entry point, every option of every CLI (the
package's and the checkout's harnesses: python -m bench, stress, tp_check) has help, the entry points forward to
their own command lines, and the demo's CPU path and --plot option."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from attnres import __main__ as cli
from attnres import demo
from attnres.bench.cli import parser as bench_parser

from conftest import requires_cuda
from bench.cli import parser as harness_bench_parser
from stress.cli import parser as stress_parser
from tp_check.cli import parser as tp_parser

ENTRY_POINTS = ("demo", "bench")
HARNESSES = ("bench", "stress", "tp_check")  # run from a checkout: python -m NAME


def _subparsers(p: argparse.ArgumentParser):
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _all_parsers():
    """Every (name, parser) of every CLI, subcommands included (the forwarded stubs of the top level are listed
    by their own CLIs)."""
    out = [("attnres", cli.parser()), ("attnres.bench", bench_parser()), ("bench", harness_bench_parser()),
           ("stress", stress_parser()), ("tp_check", tp_parser())]
    for name, p in list(out):
        for sub, sp in _subparsers(p):
            if not (name == "attnres" and sub in cli.FORWARDED):
                out.append((f"{name} {sub}", sp))
    return out


def test_top_level_help_lists_every_entry_point_with_a_line():
    completed = subprocess.run([sys.executable, "-m", "attnres", "--help"], capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    for name in ENTRY_POINTS:
        line = next((ln for ln in lines if ln.strip().startswith(name + " ")), None)
        assert line is not None and len(line.split()) > 3, f"no help line for {name}:\n{completed.stdout}"


def test_every_option_of_every_cli_has_help():
    missing = []
    for name, p in _all_parsers():
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name}: {'/'.join(action.option_strings) or action.dest}")
        for sub, sp in _subparsers(p):
            if not (name == "attnres" and sub in cli.FORWARDED) and not sp.description:
                missing.append(f"{name} {sub}: no description")
    assert not missing, "options without help:\n" + "\n".join(missing)


def test_the_check_above_finds_an_option_without_help():
    p = argparse.ArgumentParser()
    p.add_argument("--documented", help="yes")
    p.add_argument("--bare")
    assert [a.dest for a in p._actions if not isinstance(a, argparse._HelpAction) and not a.help] == ["bare"]


def test_user_help_holds_no_developer_notes():
    """The help texts are for users: no talk of where code lives or why it was written so."""
    for name, p in _all_parsers():
        text = p.format_help()
        for phrase in ("entry points live", "__main__", "spawned ranks can import"):
            assert phrase not in text, f"{name}: {phrase!r} in its help"


@pytest.mark.parametrize("command", ["bench"])
def test_entry_points_forward_to_their_own_command_line(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert f"python -m attnres.{command}" in capsys.readouterr().out


def test_forwarded_arguments_reach_the_tool():
    with pytest.raises(SystemExit, match="--tokens must be"):  # the tool's own refusal, not argparse's
        cli.main(["bench", "chain", "--device", "cpu", "--tokens", "0"])


@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_command_lines_name_their_module(harness, capsys):
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"{harness}.cli").main(["--help"])
    assert exc.value.code == 0
    assert f"python -m {harness} " in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ the demo
def _demo(*extra):
    return cli.main(["demo", "--device", "cpu", "--hidden", "128", "--layers", "13", "--block", "4",
                     "--tokens", "1,3", "--repeats", "3", *extra])


def test_demo_cpu_reports_paths_bitwise_identity_and_timings_as_not_a_measurement(capsys):
    assert _demo() == 0
    out = capsys.readouterr().out
    assert "fold off: paths" in out and "fold on : paths" in out
    assert "fused_add2 [cpu]" in out and "defer" in out and "fused_add [cpu]" in out
    for T in (1, 3):
        assert f"T =   {T}: identical over" in out and "equal the model's eager step" in out
    assert "step time, CPU, eager, wall clock (median of 3" in out and "p10-p90" in out
    assert out.count("the spread") == 2  # one verdict per T
    assert demo.CPU_NOTE in out
    assert "CUDA-graph replay of one decode step" not in out  # the GPU wording belongs to the GPU path


def _pair(off_us, on_us, noise_us):
    off = {"median_us": off_us}
    on = {"median_us": on_us, "saving_noise_us": noise_us}
    return off, on


def test_timing_verdict_separates_a_difference_from_noise():
    assert "within the spread" in demo.timing_verdict(*_pair(1000.0, 990.0, 50.0))
    assert "within the spread" in demo.timing_verdict(*_pair(990.0, 1000.0, 50.0))
    assert "outside the spread, fold on is faster" in demo.timing_verdict(*_pair(1000.0, 900.0, 50.0))
    assert "outside the spread, fold off is faster" in demo.timing_verdict(*_pair(900.0, 1000.0, 50.0))


def test_demo_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert _demo("--plot", str(path)) == 0
    assert f"plot: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_demo_plot_without_matplotlib_fails_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert _demo("--plot", str(tmp_path / "x.png")) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err and "paths" not in captured.out


def test_demo_rejects_bad_arguments(capsys):
    assert cli.main(["demo", "--device", "cpu", "--hidden", "260"]) == 2  # H not a multiple of 8
    assert "hidden_size" in capsys.readouterr().err
    for bad in (["--repeats", "0"], ["--tokens", "0"], ["--tokens", "1,x"], ["--layers", "-1"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["demo", *bad])
        assert exc.value.code == 2, bad


def test_demo_default_cpu_command_is_fast():
    """The README's main command on the CPU (tools/setup_and_demo.sh) with its defaults."""
    completed = subprocess.run([sys.executable, "-m", "attnres", "demo", "--device", "cpu"], capture_output=True,
                               text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert "identical over" in completed.stdout and demo.CPU_NOTE in completed.stdout


@requires_cuda
def test_demo_on_the_gpu_times_cuda_graph_replays(tmp_path, capsys):
    path = tmp_path / "demo.png"
    assert cli.main(["demo", "--device", "cuda", "--layers", "13", "--tokens", "1,8", "--repeats", "5",
                     "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "CUDA-graph replay of one decode step" in out and "saves" in out and "per MoE layer" in out
    assert "T =   1: identical over" in out and "T =   8: identical over" in out
    assert demo.CPU_NOTE not in out and path.stat().st_size > 10_000
