"""What the engine plugins share: the on/off switch, the per-reason fallback record, the measured tables.

A table says, per call form ("site"), token count and candidate count, whether attnres was measured faster
than the engine's own function on one GPU; a point it does not name is served by the engine (never slower by
construction, at the cost of missing unmeasured wins). The shipped tables are one file per engine and GPU,
tables/<engine>/<GPU name>.json (table_file); a GPU without a file runs the engine's own function everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from bisect import bisect_left
from collections import Counter
from pathlib import Path

_OFF = {"0", "false", "off", "no"}
TABLES_DIR = Path(__file__).with_name("tables")
NOT_MEASURED_HERE = "table: not measured on this GPU"


def switched_off(var: str) -> bool:
    """True when the environment variable says off (0/false/off/no, any case); unset means on."""
    return os.environ.get(var, "1").strip().lower() in _OFF


class Fallbacks:
    """Counts the calls served by the engine's own function, per reason, and logs each reason once (at debug
    level: a fallback is expected behaviour, not a fault, and a decode step makes hundreds of calls)."""

    def __init__(self, log: logging.Logger):
        self._log = log
        self._lock = threading.Lock()
        self.reasons: Counter[str] = Counter()
        self.served = 0

    def record(self, reason: str, detail: str = "") -> None:
        with self._lock:
            first = reason not in self.reasons
            self.reasons[reason] += 1
        if first:
            self._log.debug("attnres: falling back to the engine's function: %s%s", reason,
                            f" ({detail})" if detail else "")

    def reset(self) -> None:
        with self._lock:
            self.reasons.clear()
            self.served = 0


class Table:
    """A measured table (the JSON written by tools/engines/bench_*.py).

    Format: {"schema": 1, "device": <torch.cuda.get_device_name> or null, "hidden": H, "tokens": [sorted T
    points], "faster": {site: {str(T): [N, ...]}}} — the N at which attnres was faster at that measured T.
    A T between two measured points is served only when both neighbours were faster at that N (the time of
    both functions is monotone in T between the points only approximately, so one side is not enough); a T
    above the largest point is unmeasured."""

    def __init__(self, data: dict):
        if data.get("schema") != 1:
            raise ValueError(f"unknown table schema {data.get('schema')!r}")
        self.device = data.get("device")
        self.hidden = data.get("hidden")
        self.tokens = sorted(int(t) for t in data.get("tokens", []))
        self.faster = {site: {int(t): frozenset(int(n) for n in ns) for t, ns in per_t.items()}
                       for site, per_t in data.get("faster", {}).items()}

    @classmethod
    def load(cls, path: Path) -> "Table":
        return cls(json.loads(Path(path).read_text()))

    @property
    def empty(self) -> bool:
        return not any(ns for per_t in self.faster.values() for ns in per_t.values())

    def decide(self, site: str, tokens: int, candidates: int, hidden: int, device: str) -> str | None:
        """None when the table says attnres is faster for this call, else the reason it does not."""
        if self.empty:
            return "table: nothing measured"
        if device != self.device:
            return "table: measured on another GPU"
        if self.hidden is not None and hidden != self.hidden:  # None: any hidden size (test runs)
            return "table: hidden size not measured"
        per_t = self.faster.get(site)
        if per_t is None:
            return "table: site not measured"
        i = bisect_left(self.tokens, tokens)
        if i == len(self.tokens):
            return "table: T above the measured range"
        around = (self.tokens[i],) if self.tokens[i] == tokens or i == 0 else (self.tokens[i - 1], self.tokens[i])
        if all(candidates in per_t.get(t, ()) for t in around):
            return None
        return "table: engine measured faster (or not measured) here"


def table_from_json(path: Path, log: logging.Logger) -> Table:
    """The shipped table; an unreadable one is an empty table (everything falls back), said once."""
    try:
        return Table.load(path)
    except Exception as e:  # a broken file must not stop the engine
        log.warning("attnres: cannot read the measured table %s (%s): every call falls back", path, e)
        return Table({"schema": 1})


def table_file(engine: str, device: str) -> Path:
    """The shipped table of `engine` for the GPU named `device` (torch.cuda.get_device_name): the name with every
    run of characters other than letters and digits made one underscore, e.g. tables/vllm/NVIDIA_H200.json."""
    return TABLES_DIR / engine / (re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + ".json")


class ShippedTables:
    """The shipped tables of one engine, each read on its GPU's first call: `load(path)` returns the table (it
    handles a broken file itself); a GPU without a file gets None (the engine serves every call there)."""

    def __init__(self, engine: str, load):
        self.engine, self._load = engine, load
        self._lock = threading.Lock()
        self._tables: dict[str, object] = {}

    def for_device(self, device: str):
        with self._lock:
            if device not in self._tables:
                path = table_file(self.engine, device)
                self._tables[device] = self._load(path) if path.is_file() else None
            return self._tables[device]
