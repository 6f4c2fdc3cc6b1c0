"""tools/persistent_ring_model.py: the persistent kernel's ring protocol under random interleavings holds its
checks, and a broken protocol (the producer copying `updated` back without the consumers' barrier) is caught."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "persistent_ring_model.py"
_spec = importlib.util.spec_from_file_location("persistent_ring_model", _PATH)
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


def test_the_protocol_holds():
    assert model.run_seeds(range(300)) > 300


@pytest.mark.parametrize("adds", [1, 2])
def test_copying_updated_without_the_barrier_is_caught(adds):
    with pytest.raises(AssertionError, match="updated copied before it was stored"):
        # a deep ring: the slot `updated` is copied into is free before the warps released their tails, so only
        # the barrier keeps the producer from running ahead of a warp's store
        for seed in range(50):
            model.run(T=4, K=1, adds=adds, S=12, W=4, grid=1, block=0, passes=2, seed=seed, sync_updated=False)


def test_two_passes_without_addends_stream_the_prefix_again():
    for seed in range(20):
        model.run(T=5, K=2, adds=0, S=2, W=3, grid=2, block=1, passes=2, seed=seed)
