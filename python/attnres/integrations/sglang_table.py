"""The measured tables the SGLang plugin consults before it replaces a call (docs/integrations.md).

One table per GPU (tables/sglang/<GPU name>.json, _common.table_file; a GPU without one runs SGLang's function
everywhere). A row says, for one entry point of sglang.srt.layers.attn_residual, one token count T and one candidate count
N = nvb + 1, whether attnres was measured faster than SGLang's own function on the table's device at the
table's hidden size. The plugin takes attnres only where the table says so, so an empty or foreign table
means SGLang's function everywhere ("never slower than the engine's own path" rests on measurements only).

Between two measured token counts a call takes attnres only when both neighbours say so (the crossover may lie
anywhere between them); below the smallest or above the largest measured T the nearest row decides (at the
extremes both paths are launch-bound or bandwidth-bound, and the ratio stops moving).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

from ._common import NOT_MEASURED_HERE, TABLES_DIR, ShippedTables

SCHEMA = 1
ENGINE = "sglang"
SHIPPED_DIR = TABLES_DIR / ENGINE
_ROW_KEYS = ("entry", "tokens", "candidates", "use_attnres")


class TableError(ValueError):
    """The table file does not follow the schema (the plugin then falls back everywhere)."""


class Table:
    def __init__(self, device: str | None, hidden: int | None, rows: list[dict], source: str = "<memory>"):
        self.device, self.hidden, self.rows, self.source = device, hidden, list(rows), source
        # (entry, N) -> sorted token counts and their verdicts
        points: dict[tuple[str, int], dict[int, bool]] = {}
        for row in self.rows:
            points.setdefault((row["entry"], row["candidates"]), {})[row["tokens"]] = bool(row["use_attnres"])
        self._points = {key: (sorted(v), [v[t] for t in sorted(v)]) for key, v in points.items()}

    @classmethod
    def empty(cls, source: str = "<empty>") -> "Table":
        return cls(None, None, [], source)

    @classmethod
    def from_dict(cls, data, source: str = "<memory>") -> "Table":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise TableError(f"{source}: not an attnres SGLang table of schema {SCHEMA}")
        rows = data.get("rows")
        if not isinstance(rows, list):
            raise TableError(f"{source}: 'rows' must be a list")
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or any(k not in row for k in _ROW_KEYS):
                raise TableError(f"{source}: row {i} lacks one of {_ROW_KEYS}")
            if not isinstance(row["entry"], str) or not _count(row["tokens"]) or not _count(row["candidates"]) \
                    or not isinstance(row["use_attnres"], bool):
                raise TableError(f"{source}: row {i} has a malformed entry, tokens, candidates or use_attnres")
        device, hidden = data.get("device"), data.get("hidden")
        if rows and (not isinstance(device, str) or not _count(hidden)):
            raise TableError(f"{source}: a table with rows must name its device and hidden size")
        return cls(device, hidden, rows, source)

    @classmethod
    def load(cls, path: str | Path) -> "Table":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TableError(f"{path}: {e}") from None
        return cls.from_dict(data, str(path))

    def verdict(self, entry: str, tokens: int, candidates: int, hidden: int, device: str) -> str | None:
        """None when attnres was measured faster for this call; otherwise why SGLang's function runs."""
        if not self.rows:
            return "table: not measured (empty table)"
        if device != self.device:
            return f"table: measured on {self.device}, not on {device}"
        if hidden != self.hidden:
            return f"table: measured at H = {self.hidden}, not at H = {hidden}"
        found = self._points.get((entry, candidates))
        if found is None:
            return f"table: {entry} not measured at N = {candidates}"
        ts, faster = found
        i = bisect.bisect_left(ts, tokens)
        if i < len(ts) and ts[i] == tokens:
            ok, where = faster[i], f"T = {tokens}"
        elif i == 0:
            ok, where = faster[0], f"T < {ts[0]}"
        elif i == len(ts):
            ok, where = faster[-1], f"T > {ts[-1]}"
        else:
            ok, where = faster[i - 1] and faster[i], f"{ts[i - 1]} < T < {ts[i]}"
        return None if ok else f"table: SGLang not measured slower at {where}, N = {candidates}"


class Shipped:
    """The shipped tables: each call's verdict comes from the table of its GPU, read on that GPU's first call (a
    malformed file reads as the empty table: SGLang's function everywhere on that GPU)."""

    source = str(SHIPPED_DIR)

    def __init__(self, on_error=None):
        def load(path):
            try:
                return Table.load(path)
            except TableError as e:
                if on_error is not None:
                    on_error(e)
                return Table.empty(str(path))
        self._tables = ShippedTables(ENGINE, load)

    def verdict(self, entry: str, tokens: int, candidates: int, hidden: int, device: str) -> str | None:
        table = self._tables.for_device(device)
        if table is None:
            return NOT_MEASURED_HERE
        return table.verdict(entry, tokens, candidates, hidden, device)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def table_dict(device: str, hidden: int, rows: list[dict], measured: dict, note: str) -> dict:
    """The JSON document of a table (tools/engines/bench_sglang.py writes it)."""
    for row in rows:
        for k in ("attnres_us", "sglang_us"):
            if row.get(k) is not None and not math.isfinite(row[k]):
                raise TableError(f"row {row['entry']} T = {row['tokens']} N = {row['candidates']}: {k} not finite")
    out = {"schema": SCHEMA, "note": note, "device": device, "hidden": hidden, "measured": measured,
           "rows": sorted(rows, key=lambda r: (r["entry"], r["candidates"], r["tokens"]))}
    Table.from_dict(out)  # never write a table the plugin would refuse
    return out
