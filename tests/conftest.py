"""Shared pytest configuration: which devices the tests run on.

CPU tests always run. CUDA tests run when this build has the CUDA backend and a device of compute
capability >= 9.0 is visible; otherwise they skip cleanly with the reason.
"""

from __future__ import annotations

import os

import pytest
import torch

import attnres


def _cuda_skip_reason() -> str | None:
    info = attnres.backend_info()
    if not info["cuda_backend"]:
        return "attnres was built without the CUDA backend"
    if not torch.cuda.is_available() or not info["cuda_devices"]:
        return "no CUDA device visible"
    major = int(info["cuda_devices"][0]["cc"].split(".")[0])
    if major < 9:
        return f"CUDA device has compute capability {info['cuda_devices'][0]['cc']} < 9.0"
    return None


def _share_cores_between_workers() -> None:
    """Under pytest-xdist every worker would otherwise start one intra-op thread per core: 8 workers on a
    16-core machine then run 128 spinning threads, and the float64 oracle of the property tests slowed by
    orders of magnitude on the H200 machine (workers killed at the test timeout). Give each worker its share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_cores_between_workers()
CUDA_SKIP_REASON = _cuda_skip_reason()
HAS_CUDA = CUDA_SKIP_REASON is None

# Use as a decorator on tests that need the GPU.
_GPU_REASON = "needs a CUDA device of compute capability >= 9.0"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=f"{_GPU_REASON}: {CUDA_SKIP_REASON}")


def pytest_collection_modifyitems(config, items):
    """Every test that requires the GPU carries the `gpu` marker, however it asked for it (decorator, module
    pytestmark, or the cuda device parameter): `pytest -m gpu` then selects exactly the GPU cases (what
    tools/gpu_check.sh runs on the H200; the CPU cases are CI's)."""
    for item in items:
        if any(str(m.kwargs.get("reason", "")).startswith(_GPU_REASON) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)

# Parametrize a test over every device: params=DEVICES gives "cpu" always and "cuda" (skipping) always, so
# the GPU cases show up as skipped rather than vanishing on machines without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.gpu])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For modules of tiny ops (the decode chain): intra-op threads only add spin-waits, ruinously so on a
    loaded 2-core CI machine running two pytest workers. Use with
    `pytestmark = pytest.mark.usefixtures("one_intra_op_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
