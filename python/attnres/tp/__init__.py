"""Tensor parallelism for attnres: the launcher (torchrun or spawned ranks, NCCL on CUDA / gloo on the CPU /
every rank a process on one GPU joined by gloo, NVLink multicast off) and the TP checks of the Kimi K3 decode
chain (docs/tp.md). The model side lives in attnres.models.kimi_k3.tp; the benchmark is `python -m bench
tp`."""

from .communicator import Communicator, CommunicatorError, InProcessWorld
from .launch import (NO_MULTICAST_ENV, RankContext, cuda_ranks_available, forbid_multicast, init, launch,
                     resolve_device, resolve_one_gpu_device, shutdown, under_torchrun)

__all__ = ["Communicator", "CommunicatorError", "InProcessWorld", "NO_MULTICAST_ENV", "RankContext", "cuda_ranks_available", "forbid_multicast", "init", "launch",
           "resolve_device", "resolve_one_gpu_device", "shutdown", "under_torchrun"]
