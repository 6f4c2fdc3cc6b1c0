"""The tensor-parallel checks of the Kimi K3 decode chain (`python -m tp_check check`, docs/tp.md): the launcher
(launch.py: torchrun or spawned ranks, NCCL on CUDA / gloo on the CPU / every rank a process on one GPU joined
by gloo, NVLink multicast off), the checks run on every rank (checks.py) and the command line (cli.py). This is
the repository's own harness, run from the root of a checkout against the attnres it imports; the
communicator it exercises is the package's (attnres.comm). The benchmark is `python -m bench tp`."""
