"""Alpha-beta collective formulas: hand-computed values, byte factors, monotonicity."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cost_models import Link
from cost_models.collectives import KINDS, collective_time, combined, ring_bytes_sent, single_axis_time

FAST = Link(name="fast", bandwidth=1e9, latency=1e-6)
SLOW = Link(name="slow", bandwidth=1e8, latency=1e-5)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 64])
def test_ring_all_reduce_moves_2_p_minus_1_over_p_n(p: int) -> None:
    n = 1_000_000
    assert ring_bytes_sent("all_reduce", n, p) == pytest.approx(2 * (p - 1) / p * n)
    assert ring_bytes_sent("all_gather", n, p) == pytest.approx((p - 1) / p * n)
    assert ring_bytes_sent("reduce_scatter", n, p) == pytest.approx((p - 1) / p * n)
    assert ring_bytes_sent("send_recv", n, p) == n


def test_hand_computed_single_axis() -> None:
    n, p = 1e6, 4
    # ring: 2(p-1)α + 2(p-1)/p n/B = 6e-6 + 1.5e-3; tree: 2·log2(4)·α + 2n/B = 4e-6 + 2e-3
    assert single_axis_time("all_reduce", n, p, FAST, algorithm="ring") == pytest.approx(1.506e-3)
    assert single_axis_time("all_reduce", n, p, FAST, algorithm="tree") == pytest.approx(2.004e-3)
    assert single_axis_time("all_reduce", n, p, FAST) == pytest.approx(1.506e-3)
    assert single_axis_time("all_gather", n, p, FAST) == pytest.approx(3e-6 + 0.75e-3)
    assert single_axis_time("reduce_scatter", n, p, FAST) == pytest.approx(3e-6 + 0.75e-3)
    assert single_axis_time("all_to_all", n, p, FAST) == pytest.approx(3e-6 + 0.75e-3)
    assert single_axis_time("send_recv", n, p, FAST) == pytest.approx(1e-6 + 1e-3)
    # tiny message on many devices: the tree's log latency wins
    assert single_axis_time("all_reduce", 8, 64, FAST) == pytest.approx(2 * 6 * 1e-6 + 16 / 1e9)


def test_hand_computed_hierarchical_all_reduce() -> None:
    n = 8e6
    # RS over the fast axis (4) + AR of n/4 over the slow axis (2) + AG over the fast axis
    rs = 3e-6 + 0.75 * n / 1e9
    ar = 2 * 1e-5 + 2 * 0.5 * (n / 4) / 1e8
    expected = rs + ar + rs
    assert collective_time("all_reduce", n, [(2, SLOW), (4, FAST)]) == pytest.approx(expected)
    # all_gather: outer on n/4 first, then inner on n
    ag = (1e-5 + 0.5 * (n / 4) / 1e8) + (3e-6 + 0.75 * n / 1e9)
    assert collective_time("all_gather", n, [(2, SLOW), (4, FAST)]) == pytest.approx(ag)


def test_equal_links_hierarchical_moves_flat_ring_bytes() -> None:
    n = 1e7
    zero_latency = Link(name="z", bandwidth=1e9, latency=0.0)
    two_level = collective_time("all_reduce", n, [(2, zero_latency), (4, zero_latency)])
    assert two_level == pytest.approx(2 * 7 / 8 * n / 1e9)


def test_trivial_groups_are_free() -> None:
    for kind in KINDS:
        assert collective_time(kind, 1e6, [(1, FAST)]) == 0
        assert collective_time(kind, 0, [(8, FAST)]) == 0
        assert collective_time(kind, 1e6, []) == 0


links = st.builds(
    Link,
    name=st.just("l"),
    bandwidth=st.floats(1e6, 1e12),
    latency=st.floats(0, 1e-3),
)
sizes = st.lists(st.integers(1, 16), min_size=1, max_size=3)


@given(kind=st.sampled_from(KINDS), n=st.floats(0, 1e10), extra=st.floats(0, 1e10), ps=sizes, link=links)
def test_more_bytes_never_cheaper(kind: str, n: float, extra: float, ps: list[int], link: Link) -> None:
    groups = [(p, link) for p in ps]
    assert collective_time(kind, n + extra, groups) >= collective_time(kind, n, groups) * (1 - 1e-12)


@given(
    kind=st.sampled_from(KINDS),
    n=st.floats(1, 1e10),
    ps=sizes,
    link=links,
    faster=st.floats(1, 100),
    lower=st.floats(0, 1),
)
def test_faster_links_never_slower(
    kind: str, n: float, ps: list[int], link: Link, faster: float, lower: float
) -> None:
    better = Link(name="l", bandwidth=link.bandwidth * faster, latency=link.latency * lower)
    slow = collective_time(kind, n, [(p, link) for p in ps])
    fast = collective_time(kind, n, [(p, better) for p in ps])
    assert fast <= slow * (1 + 1e-12)


@given(n=st.floats(1, 1e9), p=st.integers(2, 64))
def test_all_reduce_costs_about_reduce_scatter_plus_all_gather(n: float, p: int) -> None:
    ring = single_axis_time("all_reduce", n, p, FAST, algorithm="ring")
    parts = single_axis_time("reduce_scatter", n, p, FAST) + single_axis_time("all_gather", n, p, FAST)
    assert math.isclose(ring, parts, rel_tol=1e-9)


@given(sizes=st.lists(st.floats(1, 1e9), min_size=1, max_size=40), p=st.integers(2, 64))
def test_combined_all_reduces_pay_the_latency_once(sizes: list[float], p: int) -> None:
    """k ring all-reduces issued as one instruction: their shares sum to one all-reduce of all their bytes
    (the ring's price is affine in the bytes), and none is charged below 1/k of its own time."""
    k = len(sizes)
    alpha = single_axis_time("all_reduce", 1e-30, p, FAST, algorithm="ring")
    own = [single_axis_time("all_reduce", n, p, FAST, algorithm="ring") for n in sizes]
    shares = [combined(t, alpha, k) for t in own]
    assert math.isclose(sum(shares), single_axis_time("all_reduce", sum(sizes), p, FAST, algorithm="ring"),
                        rel_tol=1e-9)
    assert all(s >= t / k * (1 - 1e-12) for s, t in zip(shares, own, strict=True))
    assert combined(own[0], alpha, 1) == own[0]
