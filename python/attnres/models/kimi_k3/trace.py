"""What a decode step leaves behind for a bitwise comparison: each site's prefix, normed output and tap, and
the snapshot bank after every layer. compare_traces() lists every difference (bit patterns, so -0.0 vs 0.0
and NaN payloads count); the fold-vs-eager tests and the demo use it, and so can an engine checking its own
port of the fold. The bank is compared whole, rows not yet written included, so that a stray write shows:
give both runs banks with the same initial contents (allocate_bank(T, fill=...))."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def bitwise_equal(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        as_int = _SAME_WIDTH_INT[a.element_size()]
        return torch.equal(a.contiguous().view(as_int).cpu(), b.contiguous().view(as_int).cpu())
    return torch.equal(a.cpu(), b.cpu())


@dataclass
class SiteTrace:
    site: str
    prefix: Tensor  # the materialized prefix the site mixed
    output: Tensor  # its normed output
    tap: Tensor | None = None  # the capture tap taken there, if any
    fp8: tuple | None = None  # (codes, scales, source) of an FP8 site (residual.Fp8Output), if any


@dataclass
class ChainTrace:
    sites: list[SiteTrace] = field(default_factory=list)
    banks: list[tuple[int, Tensor]] = field(default_factory=list)  # (layer, bank storage after it)

    def site(self, name: str, prefix: Tensor, output: Tensor, tap: Tensor | None = None, fp8=None) -> None:
        # Site tensors are fresh results nobody writes later; the bank is written in place, so it is cloned.
        self.sites.append(SiteTrace(name, prefix, output, tap, fp8))

    def layer_end(self, layer: int, bank_storage: Tensor) -> None:
        self.banks.append((layer, bank_storage.clone()))


def compare_traces(a: ChainTrace, b: ChainTrace, *, fp8: bool = True) -> list[str]:
    """Every difference between two traces, as readable lines ([] when bitwise identical). `fp8`: also compare
    the FP8 codes and scales (presence included; not who produced them); False compares the bf16 chain only."""
    diffs = []
    if [s.site for s in a.sites] != [s.site for s in b.sites]:
        diffs.append("the two chains visited different sites")
    for sa, sb in zip(a.sites, b.sites, strict=False):
        for what in ("prefix", "output", "tap"):
            x, y = getattr(sa, what), getattr(sb, what)
            if not bitwise_equal(x, y):
                diffs.append(f"{sa.site}: {what} differs{_count(x, y)}")
        if fp8 and (sa.fp8 is None) != (sb.fp8 is None):
            diffs.append(f"{sa.site}: fp8 output present in one chain only")
        elif fp8 and sa.fp8 is not None:
            for i, what in enumerate(("fp8 codes", "fp8 scales")):
                x, y = sa.fp8[i], sb.fp8[i]
                if not bitwise_equal(x, y) or x.stride() != y.stride():
                    diffs.append(f"{sa.site}: {what} differ{_count(x, y)}")
    if [layer for layer, _ in a.banks] != [layer for layer, _ in b.banks]:
        diffs.append("the two chains traced the bank after different layers")
    for (layer, x), (_, y) in zip(a.banks, b.banks, strict=False):
        if not bitwise_equal(x, y):
            diffs.append(f"bank after layer {layer} differs{_count(x, y)}")
    return diffs


def compare_outputs(a, b) -> list[str]:
    """Differences between two KimiK3Output: the model output, the taps (same layers, same bits), the bank."""
    diffs = []
    if not bitwise_equal(a.output, b.output):
        diffs.append(f"model output differs{_count(a.output, b.output)}")
    if sorted(a.taps) != sorted(b.taps):
        diffs.append(f"captured layers differ: {sorted(a.taps)} vs {sorted(b.taps)}")
    for layer in sorted(set(a.taps) & set(b.taps)):
        if not bitwise_equal(a.taps[layer], b.taps[layer]):
            diffs.append(f"tap of layer {layer} differs{_count(a.taps[layer], b.taps[layer])}")
    if not bitwise_equal(a.bank.storage, b.bank.storage):
        diffs.append("final bank differs")
    return diffs


def _count(x: Tensor | None, y: Tensor | None) -> str:
    if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
        return " (presence, shape or dtype)"
    as_int = _SAME_WIDTH_INT[x.element_size()]
    n = int((x.contiguous().view(as_int) != y.contiguous().view(as_int)).sum())
    return f" ({n} of {x.numel()} elements)"
