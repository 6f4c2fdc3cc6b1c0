"""The persistent benchmark suite's code that runs without a GPU (bench/persistent.py): the grid,
the byte formula, the PyTorch step it times (against the oracle), the crossover and target P5 (docs/performance.md:
>= 85% of the copy bandwidth at T >= 4096, N = 9, with the addend) read from records, the summary, and the CLI
refusing to measure without a GPU."""

from __future__ import annotations

import pytest

from attnres import reference
from bench import persistent
from bench.cli import main as bench_main
from bench.targets import targets
from cli_checks import assert_bench_suite_cli
from helpers import assert_same_bits, make_inputs


def test_grid_is_the_brief():
    pts = persistent.points()
    assert {T for T, _, _ in pts} == {32, 64, 128, 256, 512, 1024, 4096, 16384, 32768}
    assert {N for _, N, _ in pts} == {2, 5, 9, 12}
    assert {a for _, _, a in pts} == {True, False}
    assert len(pts) == 9 * 4 * 2 == len(set(pts))
    quick = persistent.points(quick=True)
    assert set(quick) < set(pts) and any(T >= 4096 and N == 9 and a for T, N, a in quick)


def test_op_bytes():
    H, row = 7168, 2 * 7168
    # N = 9 with the addend: 8 bank rows + prefix + addend read, updated + output written, 3 weight rows.
    assert persistent.op_bytes(4096, 9, H, True) == 4096 * row * (8 + 1 + 1) + 4096 * row * 2 + 3 * row
    assert persistent.op_bytes(4096, 9, H, False) == 4096 * row * (8 + 1) + 4096 * row + 3 * row
    assert persistent.op_bytes(1, 1, 8, False) == 16 * (1 + 1 + 3)


@pytest.mark.parametrize("add", [True, False])
def test_the_timed_pytorch_step_computes_the_op(add):
    """What torch.compile is timed on is the op itself: updated bit for bit, output within the tolerance."""
    inp = make_inputs(5, 4, 256, addends=1, seed=3)
    updated, output = persistent.torch_attn_res_step(inp.layer_residual, inp.add if add else None,
                                                     inp.block_residual, inp.res_weight, inp.rms_weight,
                                                     inp.norm_weight, inp.rms_eps, inp.norm_eps)
    ref = reference.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.rms_eps,
                             layer_residual_add=inp.add if add else None, norm_weight=inp.norm_weight,
                             norm_eps=inp.norm_eps)
    assert_same_bits(updated, reference.prefix_update(inp.layer_residual, inp.add if add else None), "updated")
    reference.check_close(output, ref.output)


def _rec(provider, T, N, us, add=True, H=7168, copy_tbs=4.23):
    nbytes = persistent.op_bytes(T, N, H, add)
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"suite": "persistent", "provider": provider, "T": T, "N": N, "H": H, "add": add, "median_us": us,
            "p10_us": us, "p90_us": us, "bytes": nbytes, "gbps": gbps, "copy_tbs": copy_tbs,
            "pct_copy": 100 * gbps / (copy_tbs * 1000)}


def test_crossover_is_the_start_of_the_final_winning_run():
    us = {  # T: (persistent, per-token)
        32: (9.0, 5.0), 64: (8.0, 9.0), 128: (12.0, 11.0), 256: (14.0, 20.0), 512: (20.0, 40.0)}
    recs = []
    for T, (p, k) in us.items():
        recs += [_rec("attnres/persistent", T, 9, p), _rec("attnres/per_token", T, 9, k),
                 _rec("torch_compile_step", T, 9, 100.0)]
    # persistent also wins at T = 64, but loses again at 128: the crossover is 256
    recs += [_rec("attnres/persistent", 32, 2, 5.0, add=False), _rec("attnres/per_token", 32, 2, 4.0, add=False)]
    got = persistent.crossover(recs + [{"suite": "decode", "provider": "x"}])
    assert got == {(True, 9, 7168): 256, (False, 2, 7168): None}


def test_p5_target_reads_the_worst_large_point():
    copy = 4.23

    def at(fraction, T):
        nbytes = persistent.op_bytes(T, 9, 7168, True)
        return _rec("attnres/persistent", T, 9, nbytes / (fraction * copy * 1e12) * 1e6)

    met = persistent.p5_target([at(0.9, 4096), at(0.88, 16384), at(0.5, 1024), _rec("attnres/per_token", 4096, 9, 1)])
    assert met[0] == "P5" and met[3] is True and "88.0%" in met[2] and "T=16384" in met[2]
    missed = persistent.p5_target([at(0.9, 4096), at(0.8, 32768)])
    assert missed[3] is False and "T=32768" in missed[2]
    assert persistent.p5_target([at(0.9, 1024)]) is None
    assert any(row[0] == "P5" for row in targets([at(0.9, 4096)]))


def test_summary_lines():
    recs = []
    for T in (32, 4096):
        for N in (2, 9):
            recs += [_rec("attnres/persistent", T, N, 10.0 if T == 32 else 300.0),
                     _rec("attnres/per_token", T, N, 5.0 if T == 32 else 400.0),
                     _rec("torch_compile_step", T, N, 50.0)]
    lines = persistent.summary(recs)
    assert lines[0].startswith("persistent sweep, H=7168, with the addend")
    assert any(line.lstrip().startswith("4096") and "300.0/400.0/50.0" in line for line in lines)
    assert "crossover H=7168 N=2 add: persistent faster from T=4096 on" in lines
    assert persistent.summary([{"suite": "decode"}]) == []


def test_cli(capsys):
    assert_bench_suite_cli(capsys, "  persistent  the persistent kernel vs the per-token kernel", ["persistent"])
    with pytest.raises(SystemExit) as exc:  # refused before anything is measured, GPU or not
        bench_main(["persistent", "--hidden", "7170"])
    assert exc.value.code == 2 and "--hidden must be a multiple of 8" in capsys.readouterr().err
