"""Stress runs (docs/reliability.md, section 5): many randomly shaped calls checked against the CPU backend,
and a long Kimi K3 decode chain with the MoE-tail fold checked against the eager chain.

    python -m stress calls --count 100000 --streams 4 --device cuda
    python -m stress chain --steps 10000 --device cuda

The modules: draw (what one random call is, from its seed), inputs (its tensors, NaN where it must not read),
checks (bitwise, tolerance and input-untouched comparisons), calls (the random-call campaign: streams, CUDA
graph replays, the CPU backend as reference), chain (the decode chain, fold on vs off), cli (the command line).

Both print a JSON summary as the last line and exit 1 on any mismatch (2 on a usage or setup error). This is
the repository's own harness, run from the root of a checkout against the attnres it imports; it is not part of
the installed package.
"""

from .calls import run_calls
from .chain import chain_config, run_chain
from .checks import same_bits
from .cli import main
from .draw import Spec, draw_spec
from .inputs import Call

__all__ = ["Call", "Spec", "chain_config", "draw_spec", "main", "run_calls", "run_chain", "same_bits"]
