"""The stage/submesh DP (Alpa §5): brute force on tiny problems, golden behaviour, errors, placement, JSON."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers.inter_op import (
    InterOpInfeasibleError,
    InterOpProblem,
    InterOpSolution,
    alpa_submeshes,
    brute_force_inter_op,
    inflight_1f1b,
    inflight_gpipe,
    place_submeshes,
    solve_inter_op,
)
from solvers.inter_op.io_json import problem_from_dict, problem_to_dict
from solvers.inter_op.placement import check_placement
from solvers.inter_op.stage_dp import _DP

CLUSTERS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (3, 2), (1, 3)]


@st.composite
def tiny_problems(draw, *, memory: bool) -> InterOpProblem:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 6))
    cluster = CLUSTERS[int(rng.integers(len(CLUSTERS)))]
    subs = alpa_submeshes(cluster)
    if len(subs) > 1 and rng.random() < 0.3:  # a random subset of the shapes
        keep = rng.random(len(subs)) < 0.7
        subs = tuple(s for s, k in zip(subs, keep, strict=True) if k) or subs[:1]
    shape = (L, L, len(subs))
    t = np.round(rng.random(shape) * 10, int(rng.integers(0, 3)))  # rounding makes ties
    t[rng.random(shape) < 0.1] = np.inf
    B = int(rng.integers(1, 6))
    max_stages = None if rng.random() < 0.7 else int(rng.integers(1, 4))
    kwargs = dict(num_layers=L, cluster=cluster, submeshes=subs, stage_time=t, num_microbatches=B,
                  max_stages=max_stages)
    if memory:
        cap = InterOpProblem(**kwargs).stage_limit
        rule = draw(st.sampled_from(["1f1b", "gpipe", "random"]))
        inflight = {"1f1b": inflight_1f1b(cap, B), "gpipe": inflight_gpipe(cap, B),
                    "random": tuple(int(x) for x in rng.integers(0, 5, cap))}[rule]
        kwargs.update(static_memory=np.round(rng.random(shape) * 4), activation_memory=np.round(rng.random(shape) * 3),
                      memory_limit=float(rng.integers(2, 15)), inflight=inflight)
    return InterOpProblem(**kwargs)


def _check_against_brute_force(problem: InterOpProblem) -> None:
    try:
        ref = brute_force_inter_op(problem)
    except InterOpInfeasibleError:
        with pytest.raises(InterOpInfeasibleError):
            solve_inter_op(problem)
        return
    sol = solve_inter_op(problem)
    sol.verify(problem)
    assert sol.cost == pytest.approx(ref.cost, rel=1e-9, abs=1e-12)
    s = sol.stats
    assert s.settled + s.pruned == s.candidates and s.dp_runs >= 1


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(tiny_problems(memory=False))
def test_matches_brute_force_without_memory(problem: InterOpProblem) -> None:
    _check_against_brute_force(problem)


@_SETTINGS
@given(tiny_problems(memory=True))
def test_matches_brute_force_with_memory_and_inflight_rules(problem: InterOpProblem) -> None:
    _check_against_brute_force(problem)


def _every_candidate(problem: InterOpProblem) -> float:
    """Alpa's plain enumeration: one DP per distinct stage time, no pruning."""
    dp, best = _DP(problem), np.inf
    for tau in np.unique(dp.tt):
        res = dp.run(float(tau))
        if res is not None:
            times = [problem.stage_time[k, i, m] for k, i, m in res[1]]
            best = min(best, res[0] + (problem.num_microbatches - 1) * max(times))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_bisection_search_equals_plain_enumeration_on_larger_problems(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L, cluster, B = 8, (2, 4), int(rng.integers(2, 12))
    M = len(alpa_submeshes(cluster))
    w = rng.uniform(0.5, 2.0, L)
    pw = np.concatenate([[0.0], np.cumsum(w)])
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    n = np.array([h * d for h, d in alpa_submeshes(cluster)], dtype=float)
    t = (pw[j + 1] - pw[i])[:, :, None] / n * rng.uniform(1.0, 1.3, (L, L, M)) + 0.1 * np.log2(n)
    p = InterOpProblem(num_layers=L, cluster=cluster, stage_time=t, num_microbatches=B,
                       static_memory=(pw[j + 1] - pw[i])[:, :, None] / n, activation_memory=np.ones((L, L, M)) * 0.3,
                       memory_limit=float(rng.uniform(2.0, 6.0)))
    sol = solve_inter_op(p)
    sol.verify(p)
    assert sol.cost == pytest.approx(_every_candidate(p), rel=1e-12)
    assert sol.stats.dp_runs < sol.stats.candidates


# ---------------------------------------------------------------- golden behaviour
def _sharded_layers(weights: np.ndarray, cluster: tuple[int, int], alpha: float, **kw) -> InterOpProblem:
    """Layer ``l`` costs ``w_l``; on ``n`` devices a stage takes ``W·(1/n + α(1 - 1/n))`` (sharding overhead)."""
    L = weights.size
    pw = np.concatenate([[0.0], np.cumsum(weights)])
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    n = np.array([h * d for h, d in alpa_submeshes(cluster)], dtype=float)
    t = (pw[j + 1] - pw[i])[:, :, None] * (1 / n + alpha * (1 - 1 / n))
    return InterOpProblem(num_layers=L, cluster=cluster, stage_time=t, **kw)


def test_uniform_layers_get_balanced_stages() -> None:
    p = _sharded_layers(np.ones(8), (1, 8), alpha=0.1, num_microbatches=8)
    sol = solve_inter_op(p)
    sol.verify(p)
    # 2 stages x 4 layers on 1x4 submeshes: 2·1.3 + 7·1.3 = 11.7 beats 1, 4 or 8 stages.
    assert [(s.first_layer, s.last_layer) for s in sol.stages] == [(0, 3), (4, 7)]
    assert sol.submesh_shapes(p) == [(1, 4), (1, 4)]
    assert sol.cost == pytest.approx(11.7)
    assert sol.cost == pytest.approx(brute_force_inter_op(p).cost)
    assert sorted(sol.placement) == [(0, 0), (0, 4)]


def test_a_shape_listed_twice_is_two_layouts_of_the_same_devices() -> None:
    # (1, 4) twice: a 1-D and a 2-D layout of one host's 4 devices, each with its own prices. The 2-D one
    # is faster but holds more, so only short stages fit on it; the DP takes each stage's best layout.
    subs = ((1, 1), (1, 2), (1, 4), (1, 4))
    L = 4
    t = np.zeros((L, L, 4))
    mem = np.zeros((L, L, 4))
    for i in range(L):
        for j in range(i, L):
            k = j - i + 1
            t[i, j] = [k, k / 1.6, k / 2.5, k / 3.5]
            mem[i, j] = [k, k / 2, k / 4, k / 2]
    p = InterOpProblem(num_layers=L, cluster=(1, 8), stage_time=t, submeshes=subs, num_microbatches=8,
                       static_memory=mem, memory_limit=1.0)
    p.verify()
    sol = solve_inter_op(p)
    sol.verify(p)
    assert sol.cost == pytest.approx(brute_force_inter_op(p).cost)
    # two stages of two layers on 4 devices each, both laid out the faster way (2 x 1/2 fits 1.0)
    assert [(s.num_layers, s.submesh) for s in sol.stages] == [(2, 3), (2, 3)]
    assert sol.submesh_shapes(p) == [(1, 4), (1, 4)]
    assert sorted(sol.placement) == [(0, 0), (0, 4)]


def test_pure_pipelining_when_sharding_is_expensive() -> None:
    p = _sharded_layers(np.ones(8), (1, 8), alpha=0.5, num_microbatches=32)
    sol = solve_inter_op(p)
    assert [s.num_layers for s in sol.stages] == [1] * 8
    assert sol.submesh_shapes(p) == [(1, 1)] * 8


def test_heavy_layer_gets_its_own_stage_or_more_devices() -> None:
    w = np.ones(8)
    w[3] = 3.0
    p = _sharded_layers(w, (1, 8), alpha=0.1, num_microbatches=16)
    sol = solve_inter_op(p)
    sol.verify(p)
    assert sol.cost == pytest.approx(brute_force_inter_op(p).cost)
    heavy = next(s for s in sol.stages if s.first_layer <= 3 <= s.last_layer)
    devices = {id(s): p.submesh_sizes[s.submesh] for s in sol.stages}
    others = [devices[id(s)] for s in sol.stages if s is not heavy]
    assert heavy.num_layers == 1 or devices[id(heavy)] > max(others, default=0)
    stage_times = [s.time for s in sol.stages]
    assert max(stage_times) - min(stage_times) < 0.5 * max(stage_times)  # still roughly balanced


def test_tight_memory_forces_more_stages() -> None:
    # Data parallel inside a stage: every device holds the stage's parameters (1 unit per layer).
    L, cluster = 8, (1, 8)
    base = _sharded_layers(np.ones(L), cluster, alpha=0.01, num_microbatches=4)
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    static = np.repeat((j - i + 1)[:, :, None].astype(float), base.num_submeshes, axis=2)
    loose = InterOpProblem(num_layers=L, cluster=cluster, stage_time=base.stage_time, num_microbatches=4,
                           static_memory=static)
    assert solve_inter_op(loose).num_stages == 1
    tight = InterOpProblem(num_layers=L, cluster=cluster, stage_time=base.stage_time, num_microbatches=4,
                           static_memory=static, memory_limit=3.0)
    sol = solve_inter_op(tight)
    sol.verify(tight)
    assert sol.num_stages >= 3 and all(s.memory <= 3.0 and s.num_layers <= 3 for s in sol.stages)
    assert sol.cost == pytest.approx(brute_force_inter_op(tight).cost)


def test_1f1b_holds_fewer_microbatches_than_gpipe() -> None:
    """Two 1-device stages: under 1F1B the first holds 2 microbatches, the last 1; GPipe holds B in both."""
    L, cluster, B = 2, (1, 2), 4
    kw = dict(num_layers=L, cluster=cluster, stage_time=np.ones((L, L, 1)), activation_memory=np.ones((L, L, 1)),
              num_microbatches=B, submeshes=((1, 1),), memory_limit=2.0)
    one_f = InterOpProblem(**kw, inflight=inflight_1f1b(2, B))
    sol = solve_inter_op(one_f)
    assert [s.memory for s in sol.stages] == [2.0, 1.0]
    with pytest.raises(InterOpInfeasibleError, match="fits in no stage"):
        solve_inter_op(InterOpProblem(**kw, inflight=inflight_gpipe(2, B)))
    assert inflight_1f1b(5, 3) == (1, 2, 3, 3, 3) and inflight_gpipe(3, 7) == (7, 7, 7)


def test_single_microbatch_minimises_the_sum_of_stage_times() -> None:
    p = _sharded_layers(np.ones(4), (1, 4), alpha=0.2, num_microbatches=1)
    sol = solve_inter_op(p)
    assert sol.num_stages == 1 and sol.submesh_shapes(p) == [(1, 4)]
    assert sol.stats.dp_runs == 1  # with B = 1, t_max costs nothing: the first run is final


def test_tolerance_prunes_more_and_stays_within_it() -> None:
    rng = np.random.default_rng(3)
    p = _sharded_layers(rng.uniform(0.5, 1.5, 16), (2, 4), alpha=0.05, num_microbatches=12)
    exact, rough = solve_inter_op(p), solve_inter_op(p, tolerance=0.05)
    rough.verify(p)
    assert exact.cost <= rough.cost <= exact.cost * 1.05 + 1e-12
    assert rough.stats.dp_runs <= exact.stats.dp_runs


def test_medium_problem_solves_quickly_and_places_on_the_cluster() -> None:
    rng = np.random.default_rng(0)
    p = _sharded_layers(rng.uniform(0.8, 1.2, 24), (4, 8), alpha=0.05, num_microbatches=16)
    sol = solve_inter_op(p)
    sol.verify(p)
    assert sum(p.submesh_sizes[s.submesh] for s in sol.stages) == 32
    assert sol.placement is not None and sol.stats.seconds < 5.0


# ---------------------------------------------------------------- errors
def test_layer_that_fits_no_stage_is_named() -> None:
    L = 3
    static = np.ones((L, L, 2))
    static[:, 1, :] = 50.0  # any stage holding layer 1 ...
    static[1:, 1:, :] = 50.0
    static[0, 2, :] = 50.0
    static[1, 1, 1] = 9.0  # ... the closest: layer 1 alone on the 2-device submesh
    p = InterOpProblem(num_layers=L, cluster=(1, 2), stage_time=np.ones((L, L, 2)), static_memory=static,
                       memory_limit=5.0)
    with pytest.raises(InterOpInfeasibleError) as info:
        solve_inter_op(p)
    err = info.value
    assert isinstance(err, ValueError) and err.layer == 1 and err.limit == 5.0
    assert err.closest == (1, 1, 1, 9.0)
    assert "layer 1 fits in no stage" in str(err) and "submesh 1 (1x2" in str(err) and "5" in str(err)


def test_layer_without_finite_time_is_named() -> None:
    t = np.ones((3, 3, 1))
    t[:, 2, :] = np.inf
    p = InterOpProblem(num_layers=3, cluster=(1, 1), stage_time=t)
    with pytest.raises(InterOpInfeasibleError, match="layer 2 has no finite stage time"):
        solve_inter_op(p)


def test_device_counts_that_cannot_fill_the_cluster() -> None:
    p = InterOpProblem(num_layers=1, cluster=(1, 8), submeshes=((1, 4),), stage_time=np.ones((1, 1, 1)))
    with pytest.raises(InterOpInfeasibleError, match="add up to the cluster's 8 devices"):
        solve_inter_op(p)


def test_memory_infeasible_only_once_microbatches_are_in_flight() -> None:
    # Two 1-device stages are forced; each fits with one microbatch, the first cannot hold two.
    p = InterOpProblem(num_layers=2, cluster=(1, 2), submeshes=((1, 1),), stage_time=np.ones((2, 2, 1)),
                       activation_memory=np.ones((2, 2, 1)), num_microbatches=4, memory_limit=1.5)
    with pytest.raises(InterOpInfeasibleError, match="in-flight") as info:
        solve_inter_op(p)
    assert info.value.limit == 1.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(stage_time=np.ones((2, 2, 3))), r"stage_time has shape \(2, 2, 3\)"),
        (dict(submeshes=((1, 4),), stage_time=np.ones((2, 2, 1))), r"does not fit the cluster"),
        (dict(stage_time=-np.ones((2, 2, 2))), r"stage_time\[0, 0, 0\] = -1.0"),
        (dict(stage_time=np.ones((2, 2, 2)), inflight=(1,)), "inflight has 1 entries"),
        (dict(stage_time=np.ones((2, 2, 2)), memory_limit=np.inf), "memory_limit"),
        (dict(stage_time=np.ones((2, 2, 2)), num_microbatches=0), "num_microbatches"),
    ],
)
def test_verify_names_the_malformed_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InterOpProblem(num_layers=2, cluster=(1, 2), **kwargs).verify()


def test_entries_below_the_diagonal_are_ignored() -> None:
    t = np.ones((2, 2, 2))
    t[1, 0] = np.nan
    p = InterOpProblem(num_layers=2, cluster=(1, 2), stage_time=t, num_microbatches=2)
    p.verify()
    solve_inter_op(p).verify(p)


def test_solution_verify_catches_a_wrong_cost_and_a_wrong_device_count() -> None:
    p = _sharded_layers(np.ones(4), (1, 4), alpha=0.1, num_microbatches=4)
    sol = solve_inter_op(p)
    with pytest.raises(ValueError, match="recomputed step time"):
        InterOpSolution(stages=sol.stages, cost=sol.cost + 1, stats=sol.stats).verify(p)
    assert sol.submesh_shapes(p) == [(1, 4)]
    small = (dataclasses.replace(sol.stages[0], submesh=0),)
    with pytest.raises(ValueError, match="hold 1 devices; the cluster has 4"):
        InterOpSolution(stages=small, cost=sol.cost, stats=sol.stats).verify(p)
    with pytest.raises(ValueError, match="must start at layer 4"):
        InterOpSolution(stages=sol.stages * 2, cost=sol.cost, stats=sol.stats).verify(p)


# ---------------------------------------------------------------- submeshes and placement
def test_alpa_submeshes() -> None:
    assert alpa_submeshes((2, 8)) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    assert alpa_submeshes((3, 6)) == ((1, 1), (1, 2), (1, 4), (1, 6), (2, 6), (3, 6))
    assert alpa_submeshes((1, 1)) == ((1, 1),)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_alpa_shapes_summing_to_the_cluster_always_tile_it(hosts: int, log_d: int, seed: int) -> None:
    per_host = 1 << log_d
    shapes_all = alpa_submeshes((hosts, per_host))
    rng = np.random.default_rng(seed)
    left, shapes = hosts * per_host, []
    while left:
        fits = [s for s in shapes_all if s[0] * s[1] <= left]
        h, d = fits[int(rng.integers(len(fits)))]
        shapes.append((h, d))
        left -= h * d
    corners = place_submeshes((hosts, per_host), shapes)
    check_placement((hosts, per_host), shapes, corners)


def test_placement_raises_when_it_cannot_tile() -> None:
    with pytest.raises(ValueError, match="hold 12 devices; the cluster has 8"):
        place_submeshes((2, 4), [(2, 4), (1, 4)])
    with pytest.raises(ValueError, match="cannot place submesh"):
        place_submeshes((2, 6), [(1, 4), (1, 4), (1, 4)])
    with pytest.raises(ValueError, match="overlaps"):
        check_placement((1, 4), [(1, 2), (1, 2)], [(0, 0), (0, 1)])


# ---------------------------------------------------------------- JSON
def test_json_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(1)
    t = rng.random((3, 3, 3))
    t[0, 2, 1] = np.inf
    p = InterOpProblem(num_layers=3, cluster=(1, 4), stage_time=t, static_memory=rng.random((3, 3, 3)),
                       activation_memory=rng.random((3, 3, 3)), num_microbatches=5, memory_limit=3.5,
                       inflight=inflight_gpipe(3, 5), max_stages=2)
    for name in ("p.json", "p.json.gz"):
        p.to_json(tmp_path / name)
        q = InterOpProblem.from_json(tmp_path / name)
        upper = np.triu(np.ones((3, 3), bool))
        for field in ("stage_time", "static_memory", "activation_memory"):
            np.testing.assert_array_equal(getattr(q, field)[upper], getattr(p, field)[upper])
        assert (q.cluster, q.submeshes, q.num_microbatches, q.memory_limit, q.inflight, q.max_stages) == (
            p.cluster, p.submeshes, p.num_microbatches, p.memory_limit, p.inflight, p.max_stages)
        assert solve_inter_op(q).cost == solve_inter_op(p).cost
    with pytest.raises(ValueError, match="not an inter-op problem"):
        problem_from_dict({**problem_to_dict(p), "format": "other"})
