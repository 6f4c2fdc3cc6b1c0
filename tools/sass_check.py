"""Check the per-token kernels' SASS for two schedules that cost latency without changing a bit.

The per-token kernels (cpp/src/cuda/attn_res_per_token.cuh) are latency-bound: at T = 1 a step is a few DRAM
round trips, a few barriers and a chain of MUFU ops. Twice the compiler lengthened that chain without any
change to the arithmetic (found on the H200 by bisecting the regression guard's T = 1 add2 finding with
tools/ab_commits.sh: 2.97 -> 3.48 us at N = 2, 3.48 -> 3.87 us at N = 9, commit 6a81f52):

1. loads: after the grid-dependency wait (griddepcontrol.wait, SASS `ACQBULK`) the kernel loads the prefix,
   the addends and the newest bank row. They take one round trip when all are issued before any loaded
   value is used; ptxas once placed a use of the first between them (the later loads waited for it).
2. exps: the softmax's exps (MUFU.EX2) must be one branch-free run, so they overlap; a select on the result
   (`n < N ? __expf(x) : 0`) was compiled into a branch around each exp.

    python3 tools/sass_check.py FILE.sass     (cuobjdump -sass LIBRARY.so, or nvdisasm -c FILE.cubin)

Prints one line per attn_res_per_token_kernel instance; exits 1 if any fails, 2 if none was found.
"""

from __future__ import annotations

import re
import sys

# A function starts at cuobjdump's "Function : NAME" or at nvdisasm's ".text.NAME:" label.
_HEADER = re.compile(r"^\s*(?:\S+\s+)?Function : (\S+)|^\s*\.text\.(\S+):\s*$")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_REG = re.compile(r"\bR(\d+)(\.64)?\b")
_GUARD = re.compile(r"^@!?U?P\w+\s+")
KERNEL = "attn_res_per_token_kernel"


def functions(sass: str, kernel: str = KERNEL) -> dict[str, list[str]]:
    """The instructions (guard, opcode, operands) of every function whose name contains `kernel`."""
    funcs: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = _HEADER.search(line)
        if m:
            name = m.group(1) or m.group(2)
            current = name if kernel in name else None
            if current:
                funcs[current] = []
            continue
        if current is not None:
            m = _INSN.search(line)
            if m:
                funcs[current].append(m.group(1))
    return funcs


def _split(insn: str) -> tuple[str, str]:
    op, _, operands = _GUARD.sub("", insn).partition(" ")
    return op, operands


def _regs(text: str) -> set[int]:
    out: set[int] = set()
    for m in _REG.finditer(text):
        n = int(m.group(1))
        out.update((n, n + 1) if m.group(2) else (n,))
    return out


def check_loads(insns: list[str]) -> tuple[bool, str]:
    """From the wait to the last global load before the next barrier, nothing reads or overwrites a register
    that an earlier load of that window fills."""
    start = next((i for i, s in enumerate(insns) if "ACQBULK" in s), None)
    if start is None:
        return False, "no ACQBULK (griddepcontrol.wait)"
    # The next block barrier: __syncthreads (BAR.SYNC) or __syncthreads_count/_and/_or (BAR.RED), which the
    # kernel places right after its post-wait loads; no load moves across it.
    end = next((i for i in range(start, len(insns)) if re.search(r"\bBAR\.(SYNC|RED)", insns[i])), len(insns))
    loads = [i for i in range(start, end) if _split(insns[i])[0].startswith("LDG")]
    if not loads:
        return False, "no global load after the wait"
    inflight: set[int] = set()
    for i in range(start + 1, loads[-1] + 1):
        op, operands = _split(insns[i])
        hit = _regs(operands) & inflight
        if hit:
            return False, (f"{op} at +{i - start} touches R{min(hit)} of an earlier load before the last of "
                           f"{len(loads)} loads (+{loads[-1] - start})")
        if op.startswith("LDG"):
            m = _REG.match(operands.split(",")[0].strip())
            if m:
                n = int(m.group(1))
                inflight.update(range(n, n + (4 if ".128" in op else 2 if ".64" in op else 1)))
    return True, f"{len(loads)} loads within +{loads[-1] - start} of the wait"


def check_exps(insns: list[str]) -> tuple[bool, str]:
    """No branch between the first and the last MUFU.EX2."""
    exps = [i for i, s in enumerate(insns) if "MUFU.EX2" in s]
    if not exps:
        return False, "no MUFU.EX2"
    branches = sum(1 for i in range(exps[0], exps[-1]) if _split(insns[i])[0] == "BRA")
    if branches:
        return False, f"{branches} branches among {len(exps)} exps"
    return True, f"{len(exps)} exps branch-free"


def check(insns: list[str]) -> tuple[bool, str]:
    results = [check_loads(insns), check_exps(insns)]
    return all(ok for ok, _ in results), "; ".join(detail for _, detail in results)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[1]) as f:
        funcs = functions(f.read())
    if not funcs:
        print(f"no {KERNEL} instance in {argv[1]}")
        return 2
    bad = 0
    for name, insns in sorted(funcs.items()):
        ok, detail = check(insns)
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name[:88]:88s} {detail}")
    print(f"{len(funcs) - bad} of {len(funcs)} instances pass")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
