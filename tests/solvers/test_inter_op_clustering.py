"""Operator clustering (Alpa §5.2): the DP against brute force, golden splits, relaxation, errors."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers.inter_op.brute_force import brute_force_clustering
from solvers.inter_op.clustering import Clustering, ClusteringProblem, cluster_layers


@st.composite
def tiny_problems(draw) -> ClusteringProblem:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = int(rng.integers(1, 10))
    L = int(rng.integers(1, n + 1))
    flops = rng.integers(0, 10, n).astype(float) if rng.random() < 0.7 else rng.random(n) * 10
    cuts = rng.integers(0, 5, n - 1).astype(float)  # small integers: many ties for the tie-break
    allowed = rng.random(n - 1) < 0.8
    k = min(int(rng.integers(0, 3)), n - 1, L - 1)
    forced = rng.choice(n - 1, size=k, replace=False).tolist() if n > 1 else []
    balance = draw(st.sampled_from([0.0, 0.1, 0.25, 1.0]))
    return ClusteringProblem(flops=flops, cut_bytes=cuts, num_layers=L, balance=balance, forced=forced,
                             allowed=allowed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems())
def test_matches_brute_force(problem: ClusteringProblem) -> None:
    try:
        problem.verify()
    except ValueError:
        with pytest.raises(ValueError):
            cluster_layers(problem)
        return
    ref, got = brute_force_clustering(problem), cluster_layers(problem)
    got.verify(problem)
    assert got.balance_used == ref.balance_used
    assert got.cut_cost == pytest.approx(ref.cut_cost, abs=1e-9)
    assert got.layer_flops.max() == pytest.approx(ref.layer_flops.max(), rel=1e-6)
    assert set(problem.forced) <= set(got.boundaries)


def test_uniform_ops_split_evenly() -> None:
    p = ClusteringProblem(flops=np.ones(12), cut_bytes=np.full(11, 7.0), num_layers=4)
    c = cluster_layers(p)
    assert c.boundaries == (2, 5, 8)
    np.testing.assert_array_equal(c.layer_flops, [3, 3, 3, 3])
    assert c.cut_cost == 21.0 and c.balance_used == 0.25
    np.testing.assert_array_equal(c.layer_of(12), np.repeat(np.arange(4), 3))
    assert c.layer_ranges(12) == [(0, 2), (3, 5), (6, 8), (9, 11)]


def test_cheap_boundary_is_preferred_when_the_balance_allows_it() -> None:
    cuts = np.full(7, 10.0)
    cuts[2] = 1.0  # after op 2: layers of 3 and 5 flops; the mean is 4
    loose = cluster_layers(ClusteringProblem(flops=np.ones(8), cut_bytes=cuts, num_layers=2, balance=0.25))
    assert loose.boundaries == (2,) and loose.cut_cost == 1.0  # 5 <= 1.25 · 4
    tight = cluster_layers(ClusteringProblem(flops=np.ones(8), cut_bytes=cuts, num_layers=2, balance=0.1))
    assert tight.boundaries == (3,) and tight.cut_cost == 10.0  # 5 > 1.1 · 4: the even split wins


def test_forced_boundaries_are_respected_and_balance_relaxed() -> None:
    p = ClusteringProblem(flops=np.ones(8), cut_bytes=np.ones(7), num_layers=2, forced=[0])
    c = cluster_layers(p)
    assert c.boundaries == (0,)
    assert c.balance_used == 1.0  # 7 flops in one layer needs 1 + δ >= 7/4: 0.25 -> 0.5 -> 1.0
    c.verify(p)
    p3 = ClusteringProblem(flops=np.ones(12), cut_bytes=np.ones(11), num_layers=4, forced=[4])
    c3 = cluster_layers(p3)
    assert 4 in c3.boundaries and c3.layer_flops.max() == 4.0  # 5 ops | 7 ops, each split in two


def test_disallowed_positions_are_avoided() -> None:
    allowed = np.ones(11, bool)
    allowed[[2, 5, 8]] = False
    c = cluster_layers(ClusteringProblem(flops=np.ones(12), cut_bytes=np.ones(11), num_layers=4, allowed=allowed))
    assert not set(c.boundaries) & {2, 5, 8}
    assert c.layer_flops.max() == 4.0


def test_zero_balance_relaxes_from_an_eighth() -> None:
    c = cluster_layers(ClusteringProblem(flops=np.ones(5), cut_bytes=np.ones(4), num_layers=2, balance=0.0))
    assert c.balance_used == 0.25 and c.layer_flops.max() == 3.0  # 3 <= (1 + δ)·2.5 first holds at δ = 0.25


def test_larger_problem_is_balanced_and_verifies() -> None:
    rng = np.random.default_rng(0)
    n, L = 3000, 40
    flops = rng.random(n) * 10
    flops[rng.random(n) < 0.5] = 0.0
    cuts = np.where(np.arange(n - 1) % 30 == 29, 1.0, 100.0)  # cheap cuts every 30 ops
    p = ClusteringProblem(flops=flops, cut_bytes=cuts, num_layers=L)
    c = cluster_layers(p)
    c.verify(p)
    assert c.cut_cost == pytest.approx(L - 1)  # every boundary at a cheap cut
    assert c.layer_flops.max() <= 1.25 * flops.sum() / L * (1 + 1e-9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(flops=np.ones(4), cut_bytes=np.ones(3), num_layers=2, forced=[0, 1]), "make 3 layers"),
        (dict(flops=np.ones(4), cut_bytes=np.ones(3), num_layers=3, allowed=[True, False, False]),
         "only 1 boundary"),
        (dict(flops=np.ones(4), cut_bytes=np.ones(4), num_layers=2), "4 ops have 3 boundaries"),
        (dict(flops=[1.0, -1.0], cut_bytes=[1.0], num_layers=1), r"flops\[1\]"),
        (dict(flops=np.ones(3), cut_bytes=np.ones(2), num_layers=4), "between 1 and the op count 3"),
        (dict(flops=np.ones(3), cut_bytes=np.ones(2), num_layers=2, forced=[5]), "outside 0..1"),
    ],
)
def test_verify_names_the_problem(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cluster_layers(ClusteringProblem(**kwargs))


def test_clustering_verify_catches_bad_boundaries() -> None:
    p = ClusteringProblem(flops=np.ones(6), cut_bytes=np.ones(5), num_layers=2, forced=[1])
    with pytest.raises(ValueError, match="forced boundaries"):
        Clustering(boundaries=(2,), layer_flops=np.array([3.0, 3.0]), cut_cost=1.0, balance_used=0.25).verify(p)
    with pytest.raises(ValueError, match="cap"):
        Clustering(boundaries=(1,), layer_flops=np.array([2.0, 4.0]), cut_cost=1.0, balance_used=0.25).verify(p)
