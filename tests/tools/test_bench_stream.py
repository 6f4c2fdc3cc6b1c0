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
    assert sb.points() == [(T, N, add) for add in (False, True) for N in (1, 2, 3, 4) for T in (256, 1024, 4096, 16384)]
    assert sb.points(tokens=(256,), candidates=(1,)) == [(256, 1, False), (256, 1, True)]
    records = [_rec("buffers:2", 50.0), _rec("buffers:4", 40.0, slots=4), _rec("split_k", 90.0, bits=False),
               {"suite": "stream_buffers", "provider": "buffers:3", "T": 4096, "N": 1, "H": 7168, "add": False,
                "declined": "not built"}]
    assert sb.differing(records) == [(4096, 1, False, "split_k")]
    lines = sb.summary(records)
    assert lines[0] == "stream buffers T=4096 N=1 no add (copy floor 3.00 TB/s)"
    assert any("buffers:4" in line and "1.250x two buffers" in line and "4 buffers" in line for line in lines)
    assert any("split_k" in line and "BITS DIFFER" in line for line in lines)
    assert "  buffers:3  declined: not built" in lines


def test_cli(capsys):
    for argv, message in ((["stream", "--candidates", "5"], "stream: --candidates must be <= 4"),
                          (["stream", "--candidates", "x"], "--candidates must be"),
                          (["stream", "--variants"], "--variants applies to the persistent suite only")):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    if not torch.cuda.is_available():
        assert bench_main(["stream", "--tokens", "1024", "--candidates", "1"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
