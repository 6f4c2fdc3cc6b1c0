"""Kimi K3's configuration: the constants its residual stream depends on (from the published config), the
schedule derived from them (snapshot layers, candidate counts, MoE and full-attention layers, capture taps),
and small configurations with the same structure for tests and CPU demos."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from attnres import _C

BANK_LAYOUTS = ("snapshot_major", "token_major")

# The library's supported range (attnres/limits.hpp, read through attnres._C.limits; ops.md).
MAX_CANDIDATES = _C.limits["max_candidates"]
MAX_HIDDEN = _C.limits["max_hidden"]
HIDDEN_MULTIPLE = _C.limits["hidden_multiple"]


def hidden_supported(hidden) -> bool:
    """Whether the ops take hidden size `hidden`: an int, a multiple of HIDDEN_MULTIPLE in [HIDDEN_MULTIPLE,
    MAX_HIDDEN]."""
    return (isinstance(hidden, int) and not isinstance(hidden, bool) and HIDDEN_MULTIPLE <= hidden <= MAX_HIDDEN
            and hidden % HIDDEN_MULTIPLE == 0)


HIDDEN_RULE = f"a multiple of {HIDDEN_MULTIPLE} in [{HIDDEN_MULTIPLE}, {MAX_HIDDEN}]"


def kimi_k3_full_attention_layers(num_layers: int = 93) -> tuple[int, ...]:
    """Kimi K3's MLA layers: every fourth layer from 3 (3, 7, ..., 91) and the last one (92); the other 69
    are linear attention (KDA)."""
    return tuple(sorted(set(range(3, num_layers, 4)) | {num_layers - 1}))


@dataclass(frozen=True)
class KimiK3Config:
    hidden_size: int = 7168
    num_layers: int = 93
    snapshot_block: int = 12  # a snapshot before the attention of layers 0, 12, 24, ...
    rms_eps: float = 1e-5  # the scoring RMSNorm of every AttnRes site
    norm_eps: float = 1e-5  # the trailing RMSNorms (input/post-attention/final norm)
    first_moe_layer: int = 1  # layers below are dense MLPs
    full_attention_layers: tuple[int, ...] = field(default_factory=kimi_k3_full_attention_layers)
    # Layers whose stream a speculative drafter (DFlash/DSpark) captures; the tap of layer c fires at the
    # next consumer: layer c + 1's pre-attention site, or the output site for the last layer.
    capture_layers: tuple[int, ...] = (1, 19, 37, 54, 72, 90)
    bank_layout: str = "snapshot_major"  # [Kmax, T, H] or token-major [T, Kmax, H]

    # The real MLP shapes, for reference (the stand-ins below work in a low-rank slice of them).
    dense_intermediate: int = 33792
    num_experts: int = 896
    experts_per_token: int = 16
    expert_width: int = 3072
    moe_latent: int = 3584
    shared_expert_width: int = 6144  # the two shared experts as one gated MLP

    # Stand-in sub-layers: width of the slice they read, experts of the stand-in router, weight seed.
    standin_rank: int = 128
    standin_experts: int = 8
    standin_top_k: int = 2
    seed: int = 0

    def __post_init__(self):
        H = self.hidden_size
        if not hidden_supported(H):
            raise ValueError(f"KimiK3Config.hidden_size must be {HIDDEN_RULE}, got {H!r}")
        if self.num_layers < 1:
            raise ValueError(f"KimiK3Config.num_layers must be >= 1, got {self.num_layers}")
        if self.snapshot_block < 1:
            raise ValueError(f"KimiK3Config.snapshot_block must be >= 1, got {self.snapshot_block}")
        if self.output_candidates > MAX_CANDIDATES:
            raise ValueError(f"KimiK3Config: {self.num_layers} layers with snapshot_block {self.snapshot_block} "
                             f"give N = {self.output_candidates} candidates at the output; the ops take N <= "
                             f"{MAX_CANDIDATES}")
        for name in ("full_attention_layers", "capture_layers"):
            bad = [layer for layer in getattr(self, name) if not 0 <= layer < self.num_layers]
            if bad:
                raise ValueError(f"KimiK3Config.{name} holds layers outside [0, {self.num_layers}): {bad}")
        if self.bank_layout not in BANK_LAYOUTS:
            raise ValueError(f"KimiK3Config.bank_layout must be one of {BANK_LAYOUTS}, got {self.bank_layout!r}")
        if not 1 <= self.standin_rank <= H:
            raise ValueError(f"KimiK3Config.standin_rank must be in [1, hidden_size], got {self.standin_rank}")
        if not 1 <= self.standin_top_k <= self.standin_experts:
            raise ValueError("KimiK3Config.standin_top_k must be in [1, standin_experts]")
        if not (self.rms_eps >= 0 and self.norm_eps >= 0):
            raise ValueError("KimiK3Config: eps must be >= 0")

    # ------------------------------------------------------------------------------------ the schedule
    @property
    def num_snapshots(self) -> int:
        """Kmax: snapshot rows the bank needs (8 for Kimi K3)."""
        return (self.num_layers - 1) // self.snapshot_block + 1

    def is_snapshot_layer(self, layer: int) -> bool:
        return layer % self.snapshot_block == 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_moe_layer

    def is_full_attention_layer(self, layer: int) -> bool:
        return layer in self.full_attention_layers

    def pre_attention_candidates(self, layer: int) -> int:
        """N at layer `layer`'s pre-attention site: (L-1)//block + 2 for L >= 1; 1 at layer 0 (no snapshot yet:
        a plain RMSNorm)."""
        return 1 if layer == 0 else (layer - 1) // self.snapshot_block + 2

    def pre_mlp_candidates(self, layer: int) -> int:
        return layer // self.snapshot_block + 2

    @property
    def output_candidates(self) -> int:
        return self.num_snapshots + 1

    def tap_layer_at(self, layer: int) -> int | None:
        """The captured layer whose tap fires at layer `layer`'s pre-attention site (its next consumer)."""
        return layer - 1 if (layer - 1) in self.capture_layers else None

    @property
    def final_layer_captured(self) -> bool:
        return (self.num_layers - 1) in self.capture_layers

    # ------------------------------------------------------------------------------------ constructors
    @classmethod
    def real(cls, **overrides) -> "KimiK3Config":
        """Kimi K3 as published: H = 7168, 93 layers, snapshot block 12 (N <= 9), eps 1e-5."""
        return cls(**overrides)

    @classmethod
    def small(cls, hidden_size: int = 256, num_layers: int = 26, snapshot_block: int = 4, *,
              capture_layers: tuple[int, ...] | None = None, **overrides) -> "KimiK3Config":
        """The same structure at test size: MLA on every fourth layer from 3 and the last, MoE from layer 1;
        by default captures a layer whose tap fires on a snapshot layer and one mid-block."""
        if capture_layers is None:
            capture_layers = tuple(c for c in (1, snapshot_block - 1, 2 * snapshot_block + 2) if c < num_layers - 1)
            capture_layers = tuple(sorted(set(capture_layers)))
        kw = dict(hidden_size=hidden_size, num_layers=num_layers, snapshot_block=snapshot_block,
                  full_attention_layers=kimi_k3_full_attention_layers(num_layers), capture_layers=capture_layers,
                  standin_rank=min(64, hidden_size), standin_experts=4)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def cpu(cls, **overrides) -> "KimiK3Config":
        """The small CPU config the command-line tools share (`python -m attnres demo`, `python -m attnres.bench
        chain --device cpu`, `python -m stress chain --device cpu`): Kimi K3's structure (dense layer 0,
        MoE from layer 1, MLA layers, taps) at small()'s size, H = 256, 26 layers, snapshot block 4, so a decode
        step takes a fraction of a second on one core. (`python -m tp_check check` has its own, shallower one:
        it runs two ranks on the same cores.)"""
        return cls.small(**overrides)

    def with_(self, **changes) -> "KimiK3Config":
        return replace(self, **changes)
