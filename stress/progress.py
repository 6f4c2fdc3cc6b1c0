"""Progress of a stress run on stderr: tqdm where it is installed (optional), else a plain line every few seconds."""

from __future__ import annotations

import sys
import time


class Progress:
    """tqdm where installed, else a line on stderr every few seconds."""

    def __init__(self, total: int, desc: str, quiet: bool):
        self.total, self.desc, self.quiet = total, desc, quiet
        self.n, self.t0, self.last = 0, time.perf_counter(), 0.0
        self.bar = None
        if not quiet:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="call" if desc == "calls" else "step", file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, n: int, note: str = "") -> None:
        self.n += n
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= 5 or self.n == self.total:
            self.last = now
            rate = self.n / max(now - self.t0, 1e-9)
            print(f"[{self.desc}] {self.n}/{self.total} ({rate:.0f}/s) {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
