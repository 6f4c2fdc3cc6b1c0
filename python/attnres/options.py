"""Options of a call: which topology and kernel, PDL, the split_k cluster size. Arguments, never read from
the environment here (the model layer's knobs in attnres.knobs feed them)."""

from __future__ import annotations

from dataclasses import dataclass

from . import _C

TOPOLOGIES = ("auto", "per_token", "persistent", "split")
KERNELS = ("auto", "cpu", "single_cta", "split_k", "persistent")
MAX_CLUSTER = _C.limits["max_cluster"]  # split_k's largest cluster (attnres/limits.hpp)
INT64_MAX = 2**63 - 1  # split_max_tokens is an int64 in the C++ Options


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Options:
    # auto (default): the kernel the H200 measured fastest for the call (split_k, the streaming single_cta for
    # N <= 2 at T >= 256, persistent for one addend from a T that depends on N, docs/ops/common.md section 6;
    # the same bits either way); per_token |
    # persistent force one family; split: per-token up to split_max_tokens
    topology: str = "auto"
    # topology "split": per-token kernels up to this T, persistent above (the default is the C++ library's)
    split_max_tokens: int = _C.Options().split_max_tokens
    pdl: bool = True  # programmatic dependent launch on the CUDA kernels
    kernel: str = "auto"  # force a kernel: auto | cpu | single_cta | split_k | persistent
    cluster: int = 0  # split_k cluster size (0: the measured default)

    def __post_init__(self):
        # Every field is checked here, at construction, so that a value the C++ Options cannot hold (an int
        # beyond int64, a bool where an int is meant) is refused with its field's name rather than deep inside
        # a torch schema or a nanobind conversion. bool is an int subclass in Python and is refused as an int.
        if not isinstance(self.topology, str) or self.topology not in TOPOLOGIES:
            raise _C.ArgumentError(f"Options.topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if not isinstance(self.kernel, str) or self.kernel not in KERNELS:
            raise _C.ArgumentError(f"Options.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not _is_int(self.split_max_tokens) or self.split_max_tokens < 0:
            raise _C.ArgumentError(f"Options.split_max_tokens must be an int >= 0, got {self.split_max_tokens!r}")
        if self.split_max_tokens > INT64_MAX:
            raise _C.ArgumentError(f"Options.split_max_tokens must be at most {INT64_MAX} (int64), "
                                   f"got {self.split_max_tokens!r}")
        if not isinstance(self.pdl, bool):
            raise _C.ArgumentError(f"Options.pdl must be a bool, got {self.pdl!r}")
        if not _is_int(self.cluster) or not 0 <= self.cluster <= MAX_CLUSTER:
            raise _C.ArgumentError(f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got {self.cluster!r}")

    def to_c(self) -> _C.Options:
        o = _C.Options()
        o.topology = getattr(_C.Topology, self.topology)
        o.split_max_tokens = self.split_max_tokens
        o.pdl = self.pdl
        o.kernel = getattr(_C.KernelKind, self.kernel)
        o.cluster = self.cluster
        return o

    # The custom ops carry options as plain arguments (torch.library schemas take str/int/bool).
    def as_args(self) -> tuple[str, int, bool, str, int]:
        return (self.topology, self.split_max_tokens, self.pdl, self.kernel, self.cluster)

    @staticmethod
    def from_args(topology: str, split_max_tokens: int, pdl: bool, kernel: str, cluster: int) -> "Options":
        return Options(topology, split_max_tokens, pdl, kernel, cluster)


DEFAULT = Options()
