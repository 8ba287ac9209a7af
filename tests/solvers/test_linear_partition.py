"""The min-max linear partition (``solvers.inter_op.linear_partition``, the interleaved schedule's cut of
layers into virtual stages): exhaustive enumeration on tiny cases, infinite groups, errors."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.inter_op import PartitionInfeasibleError, linear_partition


def _brute_force(t: np.ndarray, groups: int) -> float:
    layers = t.shape[0]
    best = np.inf
    for cuts in itertools.combinations(range(1, layers), groups - 1):
        bounds = [0, *cuts, layers]
        best = min(best, max(t[a, b - 1] for a, b in itertools.pairwise(bounds)))
    return best


@st.composite
def cases(draw) -> tuple[np.ndarray, int]:
    layers = draw(st.integers(1, 7))
    groups = draw(st.integers(1, layers))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    t = rng.integers(1, 20, size=(layers, layers)).astype(float)  # any times: not monotone in the group
    t[rng.random((layers, layers)) < draw(st.sampled_from([0.0, 0.3]))] = np.inf  # groups with no plan
    return t, groups


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_cut_is_the_best_of_every_cut(case) -> None:
    t, groups = case
    want = _brute_force(t, groups)
    if not np.isfinite(want):
        with pytest.raises(PartitionInfeasibleError):
            linear_partition(t, groups)
        return
    bounds, slowest = linear_partition(t, groups)
    assert slowest == want
    # contiguous, covering every layer once, in order, and priced as said
    assert bounds[0][0] == 0 and bounds[-1][1] == t.shape[0] - 1 and len(bounds) == groups
    assert all(b[1] + 1 == c[0] and b[0] <= b[1] for b, c in itertools.pairwise(bounds))
    assert max(t[a, b] for a, b in bounds) == slowest


def test_balanced_layers_cut_evenly_and_errors_name_the_counts() -> None:
    t = np.array([[float(j - i + 1) for j in range(8)] for i in range(8)])  # a group costs its layer count
    bounds, slowest = linear_partition(t, 4)
    assert bounds == [(0, 1), (2, 3), (4, 5), (6, 7)] and slowest == 2.0
    with pytest.raises(ValueError, match="8 layers cannot make 9"):
        linear_partition(t, 9)
