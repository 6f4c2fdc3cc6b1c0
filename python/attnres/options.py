"""Options of a call: which topology and kernel, PDL, the split_k cluster size. Arguments, never read from
the environment here (the model layer's knobs in attnres.knobs feed them)."""

from __future__ import annotations

from dataclasses import dataclass

from . import _C

TOPOLOGIES = ("auto", "per_token", "persistent", "split")
KERNELS = ("auto", "cpu", "single_cta", "split_k", "persistent")


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
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"Options.topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"Options.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not isinstance(self.split_max_tokens, int) or self.split_max_tokens < 0:
            raise ValueError(f"Options.split_max_tokens must be an int >= 0, got {self.split_max_tokens!r}")
        if not isinstance(self.cluster, int) or not 0 <= self.cluster <= 8:
            raise ValueError(f"Options.cluster must be an int in [0, 8], got {self.cluster!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"Options.pdl must be a bool, got {self.pdl!r}")

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
