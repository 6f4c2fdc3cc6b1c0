"""Benchmarks of attnres on the GPU: CUDA-graph replay, rotating input sets larger than the L2, median and
spread of repeats, variants compared interleaved in the same run (docs/performance.md).

`python -m attnres.bench --help` lists the suites."""
