"""The tensors of one drawn call on a device: fresh random values from the call's seed, laid out as its Spec
says, with NaN in every element the call must not read (spare bank rows, padding, moe rows no route names)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .draw import Spec

BF16 = torch.bfloat16
NAN = float("nan")


class Call:
    """One call's tensors on a device: `buffers` (every allocation its inputs live in, NaN where the call
    must not read), the input views, and after run() its outputs."""

    def __init__(self, spec: Spec, device: torch.device, seed: int | None = None):
        self.spec = spec
        self.device = device
        g = torch.Generator(device=device)
        g.manual_seed(spec.seed if seed is None else seed)
        self.g = g
        self.buffers: dict[str, Tensor] = {}
        self.views: dict[str, Tensor | None] = {}
        self.outputs: dict[str, Tensor] = {}
        if spec.op == "moe_finalize":
            self._build_moe()
        else:
            self._build_attn()

    # ------------------------------------------------------------------------------------------ inputs
    def _randn(self, *shape) -> Tensor:
        return torch.randn(*shape, generator=self.g, device=self.device)

    def _rand(self, *shape) -> Tensor:
        return torch.rand(*shape, generator=self.g, device=self.device)

    def _log_uniform(self, shape, lo: float, hi: float) -> Tensor:
        return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * self._rand(*shape))

    def _rows(self, name: str, T: int, H: int, values: Tensor, pad: int) -> Tensor:
        buf = torch.full((T, H + pad), NAN, dtype=BF16, device=self.device)
        buf[:, :H] = values
        self.buffers[name] = buf
        return buf[:, :H]

    def _build_attn(self) -> None:
        s = self.spec
        T, H, K = s.T, s.H, s.N - 1
        vals = (self._randn(K, T, H) * self._log_uniform((K, T, 1), 0.1, 8.0)).to(BF16)
        kmax = K + s.spare
        if s.layout == "token_major":
            bank = torch.full((T, kmax, H), NAN, dtype=BF16, device=self.device)
            bank[:, :K] = vals.transpose(0, 1)
            block = bank.transpose(0, 1)[:K]
        else:
            bank = torch.full((kmax, T, H + s.bank_pad), NAN, dtype=BF16, device=self.device)
            bank[:K, :, :H] = vals
            block = bank[:K, :, :H]
        self.buffers["bank"] = bank
        self.views["block"] = block
        self.views["prefix"] = self._rows("prefix", T, H, (self._randn(T, H) * self._log_uniform((T, 1), 0.5, 2.0))
                                          .to(BF16), s.row_pad)
        self.views["add"] = self._rows("add", T, H, (0.5 * self._randn(T, H)).to(BF16), s.row_pad) \
            if s.addends >= 1 else None
        self.views["add2"] = self._rows("add2", T, H, (0.5 * self._randn(T, H)).to(BF16), s.row_pad) \
            if s.addends >= 2 else None
        for name, scale, base in (("res_weight", 0.02, 0.0), ("rms_weight", 0.1, 1.0), ("norm_weight", 0.1, 1.0)):
            w = (base + scale * self._randn(H)).to(BF16)
            self.buffers[name] = w
            self.views[name] = w.reshape(1, H) if (name == "res_weight" and s.weight_2d) else w

    def _build_moe(self) -> None:
        s = self.spec
        T, k, D, R = s.T, s.k, s.H, s.R
        rows = torch.full((R, D + s.row_pad), NAN, dtype=BF16, device=self.device)
        perm = torch.randperm(R, generator=self.g, device=self.device)[:T * k].to(torch.int32).reshape(T, k)
        remote = self._rand(T, k) < s.remote
        index = torch.where(remote, torch.full_like(perm, -1), perm)
        named = index[index >= 0].long()
        rows[named, :D] = (self._randn(named.numel(), D) * self._log_uniform((named.numel(), 1), 0.1, 4.0)).to(BF16)
        wdtype = torch.float32 if s.weights_dtype == "float32" else BF16
        weights = self._rand(T, k).to(wdtype)
        self.buffers.update(rows=rows, index=index, weights=weights)
        self.views.update(rows=rows[:, :D], index=index, weights=weights)
        self.views["shared"] = self._rows("shared", T, D, self._randn(T, D).to(BF16), s.row_pad) if s.shared else None
        if s.norm:
            self.buffers["norm_weight"] = self.views["norm_weight"] = (1 + 0.1 * self._randn(D)).to(BF16)
        else:
            self.views["norm_weight"] = None

    def refill(self, seed: int) -> None:
        """Fresh values into every input buffer (same layout, same NaN padding), in place."""
        fresh = Call(self.spec, self.device, seed=seed)
        for name, buf in self.buffers.items():
            buf.copy_(fresh.buffers[name])

    def bank_row(self, buf: Tensor, slot: int) -> Tensor:
        s = self.spec
        return buf[:, slot] if s.layout == "token_major" else buf[slot, :, :s.H]
