"""attnres.Options checks every field at construction and raises attnres.ArgumentError (a ValueError) naming
the field, for values the C++ Options cannot hold (beyond int64, a bool for an int) as for values outside the
library's range; values at the edges of the range are taken and reach the op."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _C
from attnres.options import INT64_MAX, KERNELS, TOPOLOGIES, Options

MAX_CLUSTER = _C.limits["max_cluster"]


@pytest.mark.parametrize("kwargs, message", [
    ({"topology": "ring"}, f"Options.topology must be one of {TOPOLOGIES}, got 'ring'"),
    ({"topology": None}, f"Options.topology must be one of {TOPOLOGIES}, got None"),
    ({"topology": ["auto"]}, f"Options.topology must be one of {TOPOLOGIES}, got ['auto']"),
    ({"topology": b"auto"}, f"Options.topology must be one of {TOPOLOGIES}, got b'auto'"),
    ({"kernel": "fast"}, f"Options.kernel must be one of {KERNELS}, got 'fast'"),
    ({"kernel": "Split_K"}, f"Options.kernel must be one of {KERNELS}, got 'Split_K'"),
    ({"kernel": 0}, f"Options.kernel must be one of {KERNELS}, got 0"),
    ({"split_max_tokens": 2**63}, f"Options.split_max_tokens must be at most {INT64_MAX} (int64), got {2**63}"),
    ({"split_max_tokens": 10**30}, f"Options.split_max_tokens must be at most {INT64_MAX} (int64), got {10**30}"),
    ({"split_max_tokens": -1}, "Options.split_max_tokens must be an int >= 0, got -1"),
    ({"split_max_tokens": -(2**63) - 1}, f"Options.split_max_tokens must be an int >= 0, got {-(2**63) - 1}"),
    ({"split_max_tokens": True}, "Options.split_max_tokens must be an int >= 0, got True"),
    ({"split_max_tokens": 8.0}, "Options.split_max_tokens must be an int >= 0, got 8.0"),
    ({"split_max_tokens": "8"}, "Options.split_max_tokens must be an int >= 0, got '8'"),
    ({"split_max_tokens": None}, "Options.split_max_tokens must be an int >= 0, got None"),
    ({"pdl": 1}, "Options.pdl must be a bool, got 1"),
    ({"pdl": "yes"}, "Options.pdl must be a bool, got 'yes'"),
    ({"pdl": None}, "Options.pdl must be a bool, got None"),
    ({"cluster": MAX_CLUSTER + 1}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got {MAX_CLUSTER + 1}"),
    ({"cluster": 2**63}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got {2**63}"),
    ({"cluster": -1}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got -1"),
    ({"cluster": True}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got True"),
    ({"cluster": 2.0}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got 2.0"),
], ids=repr)
def test_every_field_rejects_with_an_argument_error_naming_it(kwargs, message):
    with pytest.raises(attnres.ArgumentError) as e:
        Options(**kwargs)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)


def test_from_args_validates_as_the_constructor():
    with pytest.raises(attnres.ArgumentError, match=r"^Options.split_max_tokens must be at most "):
        Options.from_args("auto", 2**63, True, "auto", 0)


@pytest.mark.parametrize("kwargs", [
    {"split_max_tokens": 0}, {"split_max_tokens": INT64_MAX}, {"cluster": 0}, {"cluster": MAX_CLUSTER},
    {"pdl": False}, *({"topology": t} for t in TOPOLOGIES), *({"kernel": k} for k in KERNELS),
], ids=repr)
def test_edges_of_the_range_are_taken_and_reach_the_library(kwargs):
    o = Options(**kwargs)
    c = o.to_c()
    assert (c.split_max_tokens, c.pdl, c.cluster) == (o.split_max_tokens, o.pdl, o.cluster)


def test_the_largest_split_ceiling_reaches_an_op():
    """INT64_MAX crosses the torch schema (int) and the C++ Options (int64) and runs."""
    b = torch.bfloat16
    T, K, H = 2, 3, 64
    lr, bank = torch.randn(T, H, dtype=b), torch.randn(K, T, H, dtype=b)
    w, ones = torch.randn(H, dtype=b), torch.ones(H, dtype=b)
    top = Options(topology="split", split_max_tokens=INT64_MAX)
    assert torch.equal(attnres.attn_res_rmsnorm(lr, bank, w, ones, ones, 1e-6, 1e-6, options=top),
                       attnres.attn_res_rmsnorm(lr, bank, w, ones, ones, 1e-6, 1e-6))
