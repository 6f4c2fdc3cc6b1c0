"""Starting a tensor-parallel group: the environment NCCL must see, process-group setup on NCCL (CUDA), gloo
(CPU), or gloo with every rank on cuda:0 (`one_gpu`), and a spawner for running without torchrun.

Two ways in, the same code after:

* under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set): `init()` joins the group;
* `launch(fn, nprocs, ...)`: spawns nprocs processes on this host (torch.multiprocessing), each with the
  torchrun variables set, runs fn in each and returns the per-rank results.

One GPU, W ranks (`init(..., one_gpu=True)`): NCCL refuses two ranks on one device, so the group is gloo (it
all-reduces and all-gathers CUDA tensors through the host) and every rank's tensors live on cuda:0; the one-shot
ops still run on the GPU, through attnres.comm.Communicator's CUDA IPC mapping of each process's buffers. The
processes' kernels time-slice on the device, so a cross-process spin wait progresses only at a context switch:
for correctness runs, not timing.

NVLink multicast (NVLS) is forbidden on the project's GPU machines: `forbid_multicast()` sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 in the environment before any
communicator exists (NCCL reads it when a communicator is created; spawned children inherit it). A different
value already set is overridden, with a notice on stderr.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300


def forbid_multicast(environ: dict | None = None) -> list[str]:
    """Sets NO_MULTICAST_ENV in `environ` (os.environ by default); returns the overridden 'NAME=old' entries."""
    env = os.environ if environ is None else environ
    overridden = [f"{k}={env[k]}" for k, v in NO_MULTICAST_ENV.items() if k in env and env[k] != v]
    env.update(NO_MULTICAST_ENV)
    if overridden:
        print(f"tp_check: NVLink multicast stays off: overriding {', '.join(overridden)} with "
              f"{', '.join(f'{k}={v}' for k, v in NO_MULTICAST_ENV.items())}", file=sys.stderr)
    return overridden


def under_torchrun(environ: dict | None = None) -> bool:
    env = os.environ if environ is None else environ
    return all(k in env for k in TORCHRUN_VARS)


def cuda_ranks_available(world_size: int) -> tuple[bool, str]:
    """Whether world_size ranks can each get a Hopper GPU with the attnres CUDA backend (and why not)."""
    import attnres

    info = attnres.backend_info()
    if not info["cuda_backend"]:
        return False, "attnres was built without the CUDA backend"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    hopper = [d for d in info["cuda_devices"] if int(d["cc"].split(".")[0]) >= 9]
    if len(hopper) < world_size:
        return False, f"{world_size} ranks need {world_size} Hopper GPUs, {len(hopper)} visible"
    return True, ""


def resolve_device(choice: str, world_size: int) -> str:
    """'cuda', 'cpu', or 'auto' (cuda when every rank gets a Hopper GPU, else cpu)."""
    if choice not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {choice!r}")
    if choice == "auto":
        return "cuda" if cuda_ranks_available(world_size)[0] else "cpu"
    if choice == "cuda":
        ok, why = cuda_ranks_available(world_size)
        if not ok:
            raise RuntimeError(f"tp_check: device 'cuda': {why}")
    return choice


def resolve_one_gpu_device(choice: str) -> str:
    """The device of a run with every rank on cuda:0: 'cuda' for 'cuda' or 'auto'; ValueError for any other
    choice, RuntimeError when cuda:0 cannot take the ranks (no Hopper GPU, no CUDA backend)."""
    if choice not in ("auto", "cuda"):
        raise ValueError(f"one GPU for every rank: device must be 'cuda' or 'auto', got {choice!r}")
    ok, why = cuda_ranks_available(1)
    if not ok:
        raise RuntimeError(f"tp_check: one GPU for every rank: {why}")
    return "cuda"


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl" or "gloo"
    one_gpu: bool = False  # every rank a process on cuda:0, joined by gloo

    def shards(self):
        """This rank's Shards: its own partial, joined by an all-reduce over the default group."""
        from attnres.models.kimi_k3.tp import Shards, torch_distributed_all_reduce

        return Shards.of_rank(self.rank, self.world_size, torch_distributed_all_reduce())

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Every rank's queued work done, then every rank here (a device-side all-reduce, then a sync)."""
        t = torch.zeros(1, device=self.device)
        dist.all_reduce(t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def init(device: str = "auto", *, one_gpu: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankContext:
    """Joins the group described by the torchrun variables: NCCL with one GPU per local rank ('cuda'), gloo
    ('cpu'), or, with `one_gpu`, gloo with every rank on cuda:0 ('cuda' or 'auto'). The group is warmed up (one
    all-reduce, checked) so that a CUDA-graph capture after this only records kernels."""
    forbid_multicast()
    missing = [k for k in TORCHRUN_VARS if k not in os.environ]
    if missing:
        raise RuntimeError(f"tp_check.launch.init: {', '.join(missing)} not set (run under torchrun or through "
                           "tp_check.launch.launch)")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = resolve_one_gpu_device(device) if one_gpu else resolve_device(device, local_world)
    timeout = datetime.timedelta(seconds=timeout_s)
    if one_gpu:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        backend = "gloo"
    elif device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=dev)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        backend = "gloo"
    t = torch.full((1,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    if float(t) != world * (world + 1) / 2:
        raise RuntimeError(f"tp_check.launch.init: warm-up all-reduce gave {float(t)}, expected {world * (world + 1) / 2}")
    return RankContext(rank, world, local, dev, backend, one_gpu)


def shutdown() -> None:
    """Leaves the group: collects garbage first (tensors that went through a gloo collective and lived on until
    interpreter exit made about one rank run in twenty abort there: "terminate called without an active
    exception"), then a barrier, so that no rank tears down while another still talks to it."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    result = fn(*args)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def launch(fn: Callable, nprocs: int, *args, timeout_s: float | None = None, exited_ok: bool = False) -> list:
    """Runs fn(*args) in nprocs spawned processes (ranks 0..nprocs-1 on this host, torchrun's variables set,
    multicast off); returns their results in rank order. A rank that raises makes this raise (the other ranks
    are terminated). fn must be importable (a module-level function).

    timeout_s: the whole run's bound; past it every rank still running is killed and TimeoutError raised (tests
    use it so that nothing can hang). exited_ok: a rank that exits with status 0 without returning (a fault test's
    rank that dies mid-call) gives None instead of raising."""
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}")
    import time

    import torch.multiprocessing as mp

    forbid_multicast()
    with tempfile.TemporaryDirectory(prefix="attnres_tp_") as outdir:
        ctx = mp.spawn(_worker, args=(nprocs, free_port(), outdir, fn, args), nprocs=nprocs, join=False)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not ctx.join(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"launch: the {nprocs} ranks did not finish within {timeout_s:g} s")
        finally:
            for p in ctx.processes:  # only this launch's own children, each by its handle
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for r in range(nprocs):
            path = os.path.join(outdir, f"rank{r}.pkl")
            if exited_ok and not os.path.exists(path):
                results.append(None)
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results
