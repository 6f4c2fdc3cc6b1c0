"""How fast attnres runs on this GPU: the decode sweep, the MoE finalize, the Kimi K3 decode chain with the fold off
and on, and the host cost of a call (`python -m attnres.bench --help`). CUDA-graph replay, rotating input sets
larger than the L2, median and spread of repeats, variants compared interleaved in the same run
(docs/performance.md). timing, workloads and results are the method, shared with the repository's own suites
(`python -m bench` in a checkout)."""
