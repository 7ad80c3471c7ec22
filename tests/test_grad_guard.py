"""The non-finite-gradient guard's flags (grad_guard.nonfinite_flags): by hand for every kind of
bad value, and without allocating anything of a gradient's size (issue 54: isnan() / isinf()
each made a bool copy of the whole fp32 buffer, 7.6 GB transient at 7B)."""

import math

import pytest
import torch

from hapo_openrlhf.algos.grad_guard import nonfinite_flags, norm_from_flags
from tests.conftest import largest_tensor_numel


@pytest.mark.parametrize("values, want", [
    ([1.0, -2.0, 3.0], None), ([1.0, math.nan, 3.0], math.nan), ([1.0, math.inf], math.inf),
    ([-math.inf, 2.0], math.inf), ([math.inf, -math.inf], math.inf), ([math.nan, math.inf], math.nan),
    ([3e38, 3e38], None),  # finite however large (a sum would overflow to inf here)
])
def test_flags_by_hand(values, want):
    flags = nonfinite_flags([torch.tensor(values), None, torch.zeros(0)])
    got = norm_from_flags(flags)
    assert (got is None and want is None) or (math.isnan(got) and math.isnan(want)) or got == want


def test_flags_or_over_buffers_and_bf16():
    a = torch.ones(5, dtype=torch.bfloat16)
    b = torch.tensor([1.0, math.inf])
    assert norm_from_flags(nonfinite_flags([a, b])) == math.inf
    assert norm_from_flags(nonfinite_flags([torch.tensor([math.nan])], nonfinite_flags([b]))) != \
        norm_from_flags(nonfinite_flags([torch.tensor([math.nan])], nonfinite_flags([b])))  # nan


def test_no_tensor_of_the_gradients_size_is_allocated():
    g = torch.randn(1 << 20)
    g[12345] = math.nan
    assert largest_tensor_numel(lambda: nonfinite_flags([g])) <= 2
    assert math.isnan(norm_from_flags(nonfinite_flags([g])))
