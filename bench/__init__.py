"""This repository's own benchmark suites: the regression guard, A/B and variant tooling, the kernels' geometry,
floors, peers and topology grids, FP8, the all-reduce and TP benchmarks, and the figures of docs/perf
(`python -m bench --help`). Run from the root of a checkout against the attnres it imports (installed, or
PYTHONPATH=python); not part of the installed package. The method (timing, workloads, results files) is the
package's: attnres.bench."""
