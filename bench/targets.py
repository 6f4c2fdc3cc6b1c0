"""The performance targets of docs/performance.md over the records of a run: the package's rows
(attnres.bench.results.targets: P1-P4, P6, P7) with this harness's suites' rows (P5 from the persistent suite,
"peers", "topology", "prefill" and "fp8 prefill" from theirs) after P1-P4."""

from __future__ import annotations

from attnres.bench import results

from . import fp8_prefill, peers, persistent, prefill, topology


def targets(records: list[dict]) -> list[tuple[str, str, str, bool | None]]:
    """(id, what, measured, met) per target with records: P1-P4, P5, peers, topology, prefill, fp8 prefill, P6,
    P7."""
    rows = results.targets(records)
    ours = [row for row in (persistent.p5_target(records), peers.target(records), topology.target(records),
                            prefill.target(records), fp8_prefill.target(records)) if row]
    at = next((i for i, row in enumerate(rows) if row[0] in ("P6", "P7")), len(rows))
    return rows[:at] + ours + rows[at:]
