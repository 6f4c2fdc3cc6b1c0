"""Every environment knob of the project, parsed by one set of rules and read once per process, at its first
use, so that CUDA graph capture and replay see the same values and a mistyped sweep fails instead of measuring
the default.

Importing attnres reads no knob, and neither do the ops or attnres.plan: a bad model knob must not break a
caller who only uses the ops. The model (attnres.models.kimi_k3) reads every knob (`CURRENT`) when a model or
chain is built, which is where a bad value raises; the MoE finalize gates read only their own token gate
(`value`), at their first query without an explicit max_tokens.

Grammar (docs/knobs.md):
* integer knobs: a base-10 integer, optionally signed, surrounded by optional whitespace, nothing else.
  A non-integer raises KnobError naming the knob, its allowed range and the raw value; an integer outside
  the range is clamped into it with one logged notice.
* boolean knobs: exactly "0" or "1" (whitespace around allowed); anything else raises.
* word knobs: one of the listed words (whitespace around allowed); anything else raises.
An unset or empty knob takes its default.

The library's C++ layer reads no environment: these values reach it as arguments (Options).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Mapping

from .errors import AttnResError

log = logging.getLogger("attnres.knobs")

_INT = re.compile(r"[+-]?[0-9]+")


class KnobError(AttnResError, ValueError):
    """A knob's value does not follow the grammar."""


def _text(raw: str | None) -> str | None:
    """The value without the whitespace around it; None for an unset or blank knob (it takes its default)."""
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


@dataclass(frozen=True)
class IntKnob:
    name: str
    default: int
    lo: int
    hi: int
    doc: str

    def parse(self, raw: str | None) -> int:
        text = _text(raw)
        if text is None:
            return self.default
        if not _INT.fullmatch(text):
            raise KnobError(f"{self.name}: expected a base-10 integer in [{self.lo}, {self.hi}], got {raw!r}")
        try:
            value = int(text, 10)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise KnobError(f"{self.name}: expected a base-10 integer in [{self.lo}, {self.hi}], got a "
                            f"{len(text)}-digit value") from None
        if value < self.lo or value > self.hi:
            clamped = min(max(value, self.lo), self.hi)
            log.warning("%s=%d is outside [%d, %d]; clamped to %d", self.name, value, self.lo, self.hi, clamped)
            return clamped
        return value


@dataclass(frozen=True)
class BoolKnob:
    name: str
    default: bool
    doc: str

    def parse(self, raw: str | None) -> bool:
        text = _text(raw)
        if text is None:
            return self.default
        if text not in ("0", "1"):
            raise KnobError(f"{self.name}: expected 0 or 1, got {raw!r}")
        return text == "1"


@dataclass(frozen=True)
class WordKnob:
    name: str
    default: str
    words: tuple[str, ...]
    doc: str

    def parse(self, raw: str | None) -> str:
        text = _text(raw)
        if text is None:
            return self.default
        if text not in self.words:
            raise KnobError(f"{self.name}: expected one of {', '.join(self.words)}, got {raw!r}")
        return text


KNOBS = (
    BoolKnob("KIMI_K3_MOE_TAIL_ADD_FOLD", False,
             "1: MoE layers defer their tail prefix + (routed + shared) and the next consumer folds it (add2)"),
    BoolKnob("KIMI_K3_FUSED_ATTN_RES", True, "0: every attention-residual site takes the eager reference path"),
    IntKnob("KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS", 32, 0, 16384,
            "per-rank token ceiling of the per-token fused kernels (the fold window; the split topology's ceiling)"),
    WordKnob("KIMI_K3_ATTN_RES_TOPOLOGY", "auto", ("auto", "per_token", "persistent", "split"),
             "kernel topology of the fused sites"),
    BoolKnob("KIMI_K3_AUX_ATTN_RES_STREAM", True, "what a capture tap holds: 1 the pre-norm mixture, 0 the raw prefix"),
    # One word for mode and pow2 together, so that no combination of knobs can ask for pow2 without a mode.
    WordKnob("KIMI_K3_ATTN_RES_FP8", "none", ("none", "per_token", "block128", "per_token_pow2", "block128_pow2"),
             "FP8 e4m3 output (and scales) of the sites that feed a projection GEMM: pre-attention and pre-MLP"),
    # Default 16 (the top of the range), chosen by the same-run interleaved A/B of bench_results/h200_4aed4f9.json:
    # the fused finalize took 4.9-5.5 us against 60-73 us for the unfused PyTorch sequence at every T in 1..16
    # (k = 16, D = 3584), so no token count inside the range prefers the unfused path (the seed's 2 was
    # measured on another GPU with an all-reduce inside the fused kernel).
    IntKnob("ATTNRES_MOE_FINALIZE_MAX_TOKENS", 16, 0, 16, "token gate of the fused MoE finalize; 0 disables it"),
    # Default 16 (the top of the range, the fused finalize's own ceiling), chosen by the same-run interleaved A/B of
    # bench_results/h200_f25619c_allreduce.json (in-process W = 2 world on one H200, k = 16, D = 3584): the fused
    # kernel was 2.8-3.5 us faster than finalize + one-shot all-reduce + norm at every T in 1..32.
    IntKnob("ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS", 16, 0, 16,
            "token gate of the fused MoE finalize + all-reduce + latent norm under TP; 0 disables it"),
    BoolKnob("ATTNRES_FUSED_ALL_REDUCE", True,
             "1: the TP chain joins its partials with the one-shot all-reduce ops where supported; 0: NCCL + the plain ops"),
)


@dataclass(frozen=True)
class Knobs:
    moe_tail_add_fold: bool
    fused_attn_res: bool
    fused_attn_res_max_tokens: int
    attn_res_topology: str
    aux_attn_res_stream: bool
    attn_res_fp8: str
    moe_finalize_max_tokens: int
    moe_finalize_allreduce_max_tokens: int
    fused_all_reduce: bool


_FIELDS = {
    "KIMI_K3_MOE_TAIL_ADD_FOLD": "moe_tail_add_fold",
    "KIMI_K3_FUSED_ATTN_RES": "fused_attn_res",
    "KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": "fused_attn_res_max_tokens",
    "KIMI_K3_ATTN_RES_TOPOLOGY": "attn_res_topology",
    "KIMI_K3_AUX_ATTN_RES_STREAM": "aux_attn_res_stream",
    "KIMI_K3_ATTN_RES_FP8": "attn_res_fp8",
    "ATTNRES_MOE_FINALIZE_MAX_TOKENS": "moe_finalize_max_tokens",
    "ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS": "moe_finalize_allreduce_max_tokens",
    "ATTNRES_FUSED_ALL_REDUCE": "fused_all_reduce",
}


_BY_NAME = {k.name: k for k in KNOBS}


def load(environ: Mapping[str, str] | None = None) -> Knobs:
    """Parses every knob from `environ` (default: os.environ), now, uncached. Raises KnobError on the first bad
    value."""
    env = os.environ if environ is None else environ
    return Knobs(**{_FIELDS[k.name]: k.parse(env.get(k.name)) for k in KNOBS})


# knob name -> its value, parsed from os.environ at the first read and never again (a value that does not
# parse is not stored: every later read raises again).
_read: dict[str, object] = {}
_read_lock = threading.RLock()

CURRENT: Knobs  # every knob, built at the first access (module __getattr__ below)


def _read_once(name: str):
    with _read_lock:
        if name not in _read:
            _read[name] = _BY_NAME[name].parse(os.environ.get(name))
        return _read[name]


def value(name: str):
    """The value of one knob for this process: `CURRENT`'s field once CURRENT exists (built, or replaced by a
    test), else that knob alone, read once. Another knob's bad value does not raise here."""
    if name not in _BY_NAME:
        raise KeyError(f"attnres.knobs: no knob named {name!r}")
    current = globals().get("CURRENT")
    if current is not None:
        return getattr(current, _FIELDS[name])
    return _read_once(name)


def __getattr__(attr: str):
    # CURRENT: every knob, read at the first access (module __getattr__ runs only while the global is unset),
    # then stored as a plain module global, so every later access sees the same object.
    if attr == "CURRENT":
        with _read_lock:
            current = globals().get("CURRENT")
            if current is None:
                current = Knobs(**{_FIELDS[k.name]: _read_once(k.name) for k in KNOBS})
                globals()["CURRENT"] = current
            return current
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
