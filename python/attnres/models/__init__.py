"""Model integrations built on the public attnres API. kimi_k3: Kimi K3's decode residual stream (the snapshot
bank, the 187 attention-residual sites, the MoE-tail fold) with stand-in attention and MoE sub-layers."""

from .moe_producer import MoePieces, ToyRoutedMoE

__all__ = ["MoePieces", "ToyRoutedMoE"]
