"""The communicators of the one-shot all-reduce ops (docs/ops/all_reduce.md, docs/tp.md): `Communicator`, one rank
of a torch.distributed group, and `InProcessWorld`, W ranks in one process. The model side of tensor parallelism
lives in attnres.models.kimi_k3.tp."""

from .communicator import Communicator, CommunicatorError, InProcessWorld

__all__ = ["Communicator", "CommunicatorError", "InProcessWorld"]
