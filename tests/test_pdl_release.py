"""Where the kernels release their dependents (PDL), tested where a wrong placement would show.

Every kernel of the library releases its dependents (griddepcontrol.launch_dependents) right after its own
griddepcontrol.wait (docs/ops/pdl.md). The guarantee that placement keeps: when a kernel's pre-wait section
runs, every kernel two or more launches before it has completed, so the bank rows 0..K-2 that it loads before
its wait may have been written by any of them. The newest row K-1, the prefix and the addends may come from
the launch just before and are loaded after the wait.

The chains below make a violation visible. A writer (the per-token add op with a snapshot write, T = 8192:
dozens of waves of blocks, so it is still writing its last tokens' rows when its successors could start) writes
bank row S; zero, one or two fillers follow (per-token, persistent, moe_finalize or plain PyTorch kernels, on
data of their own); then a reader (split_k or the persistent kernel) mixes the last tokens of the bank, whose
row S is one of its pre-wait rows (a newest row when no filler is between). Row S is poisoned before every
writer run. A reader that starts its pre-wait loads before the writer has finished sees the poison, and its
output differs from the same reader run on the settled bank with PDL off. Run eagerly and as a CUDA graph.
tools/pdl_teeth.sh runs this file against a build that releases at kernel entry, which must fail it.
"""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres.graphs import capture
from conftest import requires_cuda
from helpers import assert_same_bits

pytestmark = [requires_cuda, pytest.mark.gpu]

BF16 = torch.bfloat16
H = 7168
T_WRITER = 8192   # the writer's tokens: many waves of blocks
T_READER = 264    # the reader's tokens: the writer's last ones (written by its last waves)
K_WRITER = 8      # the writer mixes rows 0..7 and writes its snapshot into row S = 8
S = K_WRITER
K_MAX = S + 2     # row S + 1: the reader's newest row when row S is one of its pre-wait rows
REPEATS = 12


class Chain:
    """The buffers of one writer -> fillers -> reader chain (allocated once: the bank is 1.2 GB)."""

    def __init__(self):
        g = torch.Generator().manual_seed(2026)

        def draw(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=g)).to(BF16).cuda()

        self.bank = draw(K_MAX, T_WRITER, H, scale=2.0)
        self.prefix, self.add = draw(T_WRITER, H), draw(T_WRITER, H, scale=0.5)
        self.res_w, self.rms_w, self.norm_w = draw(H, scale=0.02), 1 + draw(H, scale=0.1), 1 + draw(H, scale=0.1)
        self.reader_prefix, self.reader_add = draw(T_READER, H), draw(T_READER, H, scale=0.5)
        # fillers' own data
        self.f_prefix, self.f_add, self.f_bank = draw(4, H), draw(4, H), draw(1, 4, H)
        self.m_rows, self.m_weights = draw(64, 3584), torch.rand(1, 16, generator=g).cuda()
        self.m_index = torch.randint(0, 64, (1, 16), generator=g, dtype=torch.int32).cuda()
        self.scratch = draw(1 << 20)
        self.poison = torch.full((T_WRITER, H), -3.0, dtype=BF16, device="cuda")

    def reader_bank(self, newest_is_s: bool):
        """The reader's candidates: the writer's last T_READER tokens, rows 0..S (S newest) or 0..S+1."""
        rows = S + 1 if newest_is_s else S + 2
        return self.bank[:rows, T_WRITER - T_READER:, :]

    def write(self):
        self.bank[S].copy_(self.poison)
        attnres.attn_res_add_rmsnorm(self.prefix, self.add, self.bank[:K_WRITER], self.res_w, self.rms_w,
                                     self.norm_w, 1e-5, 1e-5, snapshot_slot=S)

    def filler(self, kind: str):
        if kind == "per_token":
            attnres.attn_res_add_rmsnorm(self.f_prefix[:1], self.f_add[:1], self.f_bank[:, :1], self.res_w,
                                         self.rms_w, self.norm_w, 1e-5, 1e-5)
        elif kind == "persistent":
            attnres.attn_res_add_rmsnorm_persistent(self.f_prefix, self.f_bank, self.res_w, self.rms_w,
                                                    self.norm_w, 1e-5, 1e-5, layer_residual_add=self.f_add)
        elif kind == "finalize":
            attnres.moe_finalize(self.m_rows, self.m_weights, self.m_index, eps=1e-5)
        elif kind == "torch":
            self.scratch.mul_(1.0)
        else:
            raise ValueError(kind)

    def read(self, reader: str, newest_is_s: bool, pdl: bool = True):
        bank = self.reader_bank(newest_is_s)
        if reader == "split_k":
            opts = attnres.Options(kernel="split_k", pdl=pdl)
            return attnres.attn_res_add_rmsnorm(self.reader_prefix, self.reader_add, bank, self.res_w, self.rms_w,
                                                self.norm_w, 1e-5, 1e-5, options=opts)[1]
        opts = attnres.Options(topology="persistent", pdl=pdl)
        return attnres.attn_res_add_rmsnorm_persistent(self.reader_prefix, bank, self.res_w, self.rms_w, self.norm_w,
                                                       1e-5, 1e-5, layer_residual_add=self.reader_add,
                                                       options=opts)[1]

    def run(self, reader: str, fillers: tuple[str, ...]):
        self.write()
        for kind in fillers:
            self.filler(kind)
        return self.read(reader, newest_is_s=not fillers)


@pytest.fixture(scope="module")
def chain():
    c = Chain()
    yield c
    del c
    torch.cuda.empty_cache()


# The writer's row is read by the reader 1 (no filler: as its newest row), 2 or 3 launches later.
FILLERS = [(), ("per_token",), ("persistent",), ("finalize",), ("torch",), ("per_token", "persistent"),
           ("finalize", "per_token"), ("torch", "per_token"), ("persistent", "finalize")]


def _settled(chain: Chain, reader: str, fillers) -> torch.Tensor:
    chain.write()
    torch.cuda.synchronize()
    out = chain.read(reader, newest_is_s=not fillers, pdl=False).clone()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("fillers", FILLERS, ids=lambda f: "+".join(f) or "none")
@pytest.mark.parametrize("reader", ["split_k", "persistent"])
def test_reader_sees_rows_written_launches_earlier(chain, reader, fillers):
    expected = _settled(chain, reader, fillers)
    for attempt in range(REPEATS):
        got = chain.run(reader, fillers)
        torch.cuda.synchronize()
        assert_same_bits(got, expected, f"eager chain, attempt {attempt}: reader {reader} after {fillers}")


@pytest.mark.parametrize("fillers", FILLERS, ids=lambda f: "+".join(f) or "none")
@pytest.mark.parametrize("reader", ["split_k", "persistent"])
def test_reader_sees_rows_written_launches_earlier_in_graph(chain, reader, fillers):
    expected = _settled(chain, reader, fillers)
    graph, out = capture(lambda: chain.run(reader, fillers))
    for attempt in range(REPEATS):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(out, expected, f"graph replay {attempt}: reader {reader} after {fillers}")
