"""The streaming kernel's buffers benchmark (python -m bench stream) without a GPU: its points, its readers of
records (summary, bit check) and its command line."""

from __future__ import annotations

import pytest
import torch

from bench import stream_buffers as sb
from bench.cli import main as bench_main


def _rec(provider: str, us: float, bits: bool = True, slots: int = 2) -> dict:
    return {"suite": "stream_buffers", "provider": provider, "T": 4096, "N": 1, "H": 7168, "add": False,
            "copy_tbs": 3.0, "pct_copy": 80.0, "bitwise_equal": bits, "median_us": us, "p10_us": us, "p90_us": us,
            "plan": {"kernel": "single_cta", "route": "stream", "slots": slots, "smem_bytes": 1, "threads": 448}}


def test_points_and_readers():
    assert sb.points() == [(T, N, add, "norm") for add in (False, True) for N in (1, 2, 3, 4)
                           for T in (256, 1024, 4096, 16384)]
    assert sb.points(tokens=(256,), candidates=(1,)) == [(256, 1, False, "norm"), (256, 1, True, "norm")]
    assert sb.points(tokens=(256,), candidates=(1,), ops=("mix",)) == [(256, 1, False, "mix"), (256, 1, True, "mix")]
    assert [sb.op_name(add, op) for add in (False, True) for op in sb.OPS] == [
        "attn_res_rmsnorm", "attn_res", "attn_res_add_rmsnorm", "attn_res"]
    records = [_rec("buffers:2", 50.0), _rec("buffers:4", 40.0, slots=4), _rec("split_k", 90.0, bits=False),
               {"suite": "stream_buffers", "provider": "buffers:3", "T": 4096, "N": 1, "H": 7168, "add": False,
                "declined": "not built"},
               _rec("token_blocks", 45.0) | {"op": "mix", "bitwise_equal": False}]
    assert sb.differing(records) == [(4096, 1, False, "mix", "token_blocks"), (4096, 1, False, "norm", "split_k")]
    lines = sb.summary(records)
    assert "stream buffers attn_res T=4096 N=1 no add (copy floor 3.00 TB/s)" in lines
    assert "stream buffers T=4096 N=1 no add (copy floor 3.00 TB/s)" in lines
    assert any("buffers:4" in line and "1.250x two buffers" in line and "4 buffers" in line for line in lines)
    assert any("split_k" in line and "BITS DIFFER" in line for line in lines)
    assert "  buffers:3  declined: not built" in lines


def test_cli(capsys):
    for argv, message in ((["stream", "--candidates", "5"], "stream: --candidates must be <= 4"),
                          (["stream", "--candidates", "x"], "--candidates must be"),
                          (["stream", "--variants"], "--variants applies to the persistent suite only"),
                          (["stream", "--ops", "add2"], "stream: --ops must be a comma-separated subset of norm,mix"),
                          (["stream", "--fp8", "per_tensor"], "invalid choice"),
                          (["stream", "--fp8", "block128", "--ops", "norm,mix"], "stream --fp8: attn_res (op mix)"),
                          (["prefill", "--fp8", "block128"], "--fp8 applies to the stream suite only")):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    if not torch.cuda.is_available():
        assert bench_main(["stream", "--tokens", "1024", "--candidates", "1"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_fp8_variants_in_the_readers():
    """--fp8: the bytes of the FP8-only call, the header naming the mode, and default_bf16 (bits not compared: None)
    neither flagged nor counted as differing."""
    assert sb.fp8_bytes(4096, 7168, "per_token") == 4096 * 7168 - 4 * 4096
    assert sb.fp8_bytes(4096, 7168, "block128") == 4096 * 7168 - 4 * 4096 * 56
    records = [_rec("token_blocks", 80.0) | {"fp8": "block128"}, _rec("default_bf16", 78.0, bits=None) | {"fp8": None},
               _rec("split_k", 90.0) | {"fp8": "block128"}]
    assert sb.differing(records) == []
    lines = sb.summary(records)
    assert lines[0] == "stream buffers T=4096 N=1 no add fp8 block128 (FP8-only) (copy floor 3.00 TB/s)"
    assert not any("BITS DIFFER" in line for line in lines)
