"""Where the kernels release their dependents (PDL), tested where a wrong placement would show.

Every kernel of the library releases its dependents (griddepcontrol.launch_dependents) right after its own
griddepcontrol.wait (docs/ops/pdl.md). The guarantee that placement keeps: when a kernel's pre-wait section
runs, every kernel two or more launches before it has completed, so the bank rows 0..K-2 that it loads before
its wait may have been written by any of them. The newest row K-1, the prefix and the addends may come from
the launch just before and are loaded after the wait.

The chains below make a violation visible. A "sleeper" (a foreign kernel that releases its dependents at
entry and then spins for ~2 ms, longer than the host takes to launch the rest of the chain) goes first, so
the writer after it is resident early and waits on it for a long time. The writer (the per-token add op with
a snapshot write) writes bank row S only after that wait; zero, one or two fillers (per-token, persistent,
moe_finalize, the streaming or token-block single_cta or plain PyTorch kernels, on data of their own) follow; then
a reader (split_k on rows 0..S+1, the persistent kernel on S-3..S+1, the streaming and the token-block single_cta
on S-2..S+1) mixes the writer's tokens, with row S among its pre-wait rows (its newest row, loaded after the
wait, when no filler is between). Row S is poisoned before
every run. With every release after the wait, the reader's pre-wait section starts only after the writer has
completed, and its output equals, bit for bit, the same reader run on the settled bank with PDL off. A kernel
that released at entry would let the reader start while the writer still waits on the sleeper: it would read
the poison. Run eagerly and as CUDA-graph replays.

tools/pdl_teeth.sh builds a mutant whose kernels release at entry and runs this file with
ATTNRES_PDL_TEETH=1, which inverts the expectation for the chains that such a release breaks (at least one
filler, all of them PDL kernels of the library: a plain PyTorch kernel in between is launched without PDL and
starts only after the writer completed): there they must read the poison.
"""

from __future__ import annotations

import os

import pytest
import torch

import attnres
from attnres import _stream_tuning as stream
from attnres.graphs import capture
from conftest import requires_cuda
from helpers import assert_same_bits

pytestmark = [requires_cuda, pytest.mark.gpu]

BF16 = torch.bfloat16
H = 7168
# The writer's and the reader's tokens: few, as in decode, so that the kernels after the writer find room on
# the SMs while its blocks wait (at T = 64 the reader's split_k blocks did not fit beside the writer's: no
# overlap, nothing to catch).
T = 4
K_WRITER = 8      # the writer mixes rows 0..7 and writes its snapshot into row S = 8
S = K_WRITER
K_MAX = S + 2     # row S + 1: the reader's newest row when row S is one of its pre-wait rows
REPEATS = 12
SLEEP_ITERATIONS = 1_000_000  # the sleeper's dependent fma chain: ~2 ms on an H200, past the eager launches
TEETH = os.environ.get("ATTNRES_PDL_TEETH") == "1"


def _sleeper():
    """A Triton kernel that releases its dependents at entry, then spins (a foreign kernel of that kind)."""
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")

    @triton.jit
    def release_then_spin(buf, iterations):
        token = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                          dtype=tl.int32, is_pure=False, pack=1)
        x = tl.load(buf)
        for _ in range(iterations):
            x = x * 0.9999999 + 1e-7
        tl.store(buf, x + token.to(tl.float32))

    return release_then_spin


class Chain:
    """The buffers of one writer -> fillers -> reader chain (allocated once: the bank is 1.2 GB)."""

    def __init__(self):
        g = torch.Generator().manual_seed(2026)

        def draw(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=g)).to(BF16).cuda()

        self.bank = draw(K_MAX, T, H, scale=2.0)
        self.prefix, self.add = draw(T, H), draw(T, H, scale=0.5)
        self.res_w, self.rms_w, self.norm_w = draw(H, scale=0.02), 1 + draw(H, scale=0.1), 1 + draw(H, scale=0.1)
        self.reader_prefix, self.reader_add = draw(T, H), draw(T, H, scale=0.5)
        # fillers' own data
        self.f_prefix, self.f_add, self.f_bank = draw(4, H), draw(4, H), draw(1, 4, H)
        self.m_rows, self.m_weights = draw(64, 3584), torch.rand(1, 16, generator=g).cuda()
        self.m_index = torch.randint(0, 64, (1, 16), generator=g, dtype=torch.int32).cuda()
        self.scratch = draw(1 << 20)
        self.poison = torch.full((T, H), -3.0, dtype=BF16, device="cuda")
        self.sleeper, self.sleeper_buf = _sleeper(), torch.ones(1, device="cuda")

    def reader_bank(self, newest_is_s: bool, rows: int | None = None):
        """The reader's candidates: rows 0..S (S newest) or 0..S+1 of every token; the last `rows` of them when
        given (single_cta holds at most 4 candidates: 3 rows and the prefix)."""
        bank = self.bank[:S + 1 if newest_is_s else S + 2]
        return bank if rows is None else bank[-rows:]

    def write(self, sleep: bool = True):
        self.bank[S].copy_(self.poison)
        if sleep:
            self.sleeper[(1,)](self.sleeper_buf, SLEEP_ITERATIONS)
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
        elif kind == "stream":
            stream.attn_res_add_rmsnorm(stream.ALWAYS, self.f_prefix, self.f_add, self.f_bank, self.res_w,
                                        self.rms_w, self.norm_w, 1e-5, 1e-5)
        elif kind == "token_blocks":
            stream.attn_res_add_rmsnorm(stream.NEVER, self.f_prefix, self.f_add, self.f_bank, self.res_w, self.rms_w,
                                        self.norm_w, 1e-5, 1e-5, blocks_min_tokens=stream.ALWAYS)
        elif kind == "torch":
            self.scratch.mul_(1.0)
        else:
            raise ValueError(kind)

    def read(self, reader: str, newest_is_s: bool, pdl: bool = True):
        if reader == "stream":  # the streaming single_cta at every T (one token per block here)
            return stream.attn_res_add_rmsnorm(stream.ALWAYS, self.reader_prefix, self.reader_add,
                                               self.reader_bank(newest_is_s, rows=3), self.res_w, self.rms_w,
                                               self.norm_w, 1e-5, 1e-5, pdl=pdl)[1]
        if reader == "token_blocks":  # the token-block single_cta at every T
            return stream.attn_res_add_rmsnorm(stream.NEVER, self.reader_prefix, self.reader_add,
                                               self.reader_bank(newest_is_s, rows=3), self.res_w, self.rms_w,
                                               self.norm_w, 1e-5, 1e-5, pdl=pdl, blocks_min_tokens=stream.ALWAYS)[1]
        bank = self.reader_bank(newest_is_s)
        if reader == "split_k":
            opts = attnres.Options(kernel="split_k", pdl=pdl)
            return attnres.attn_res_add_rmsnorm(self.reader_prefix, self.reader_add, bank, self.res_w, self.rms_w,
                                                self.norm_w, 1e-5, 1e-5, options=opts)[1]
        # Four rows: the persistent kernel copies bank rows before its wait only into ring slots never used yet
        # (7 at H = 7168, two blocks per SM), so row S must be among its first rows to be read before the wait.
        opts = attnres.Options(topology="persistent", pdl=pdl)
        bank = self.reader_bank(newest_is_s, rows=4)
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
    return Chain()


# The writer's row is read by the reader 1 (no filler: as its newest row), 2 or 3 launches later.
FILLERS = [(), ("per_token",), ("persistent",), ("finalize",), ("stream",), ("torch",), ("per_token", "persistent"),
           ("finalize", "per_token"), ("torch", "per_token"), ("persistent", "finalize"), ("stream", "persistent"),
           ("token_blocks",), ("token_blocks", "per_token")]


def _races_under_entry_release(fillers) -> bool:
    return bool(fillers) and "torch" not in fillers


def _check(got, expected, fillers, what: str) -> bool:
    """Asserts the bits (normal run); under ATTNRES_PDL_TEETH returns whether they differed instead."""
    if TEETH and _races_under_entry_release(fillers):
        return not torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert_same_bits(got, expected, what)
    return False


def _verdict(fillers, raced: int):
    if TEETH and _races_under_entry_release(fillers):
        assert raced > 0, f"entry-release build: the reader read the settled row in all {REPEATS} runs after {fillers}"


def _settled(chain: Chain, reader: str, fillers) -> torch.Tensor:
    chain.write(sleep=False)
    torch.cuda.synchronize()
    out = chain.read(reader, newest_is_s=not fillers, pdl=False).clone()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("fillers", FILLERS, ids=lambda f: "+".join(f) or "none")
@pytest.mark.parametrize("reader", ["split_k", "persistent", "stream", "token_blocks"])
def test_reader_sees_rows_written_launches_earlier(chain, reader, fillers):
    expected = _settled(chain, reader, fillers)
    raced = 0
    for attempt in range(REPEATS):
        got = chain.run(reader, fillers)
        torch.cuda.synchronize()
        raced += _check(got, expected, fillers, f"eager chain, attempt {attempt}: reader {reader} after {fillers}")
    _verdict(fillers, raced)


@pytest.mark.parametrize("fillers", FILLERS, ids=lambda f: "+".join(f) or "none")
@pytest.mark.parametrize("reader", ["split_k", "persistent", "stream", "token_blocks"])
def test_reader_sees_rows_written_launches_earlier_in_graph(chain, reader, fillers):
    expected = _settled(chain, reader, fillers)
    graph, out = capture(lambda: chain.run(reader, fillers))
    raced = 0
    for attempt in range(REPEATS):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        raced += _check(out, expected, fillers, f"graph replay {attempt}: reader {reader} after {fillers}")
    _verdict(fillers, raced)
