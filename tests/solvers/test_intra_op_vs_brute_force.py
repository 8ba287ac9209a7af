"""The solver against exhaustive enumeration on hundreds of tiny random problems."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import InfeasibleError, IntraOpProblem, brute_force_intra_op, solve_intra_op
from solvers.intra_op.presolve import presolve


@st.composite
def tiny_problems(draw, *, memory: bool, inf_rate: float = 0.15, max_nodes: int = 6):
    n = draw(st.integers(1, max_nodes))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 4, size=n)
    structure = draw(st.sampled_from(["random", "chain", "tree", "dense"]))
    if structure == "chain":
        pairs = [(i, i + 1) for i in range(n - 1)]
    elif structure == "tree":
        pairs = [(int(rng.integers(0, i)), i) for i in range(1, n)]
    else:
        m = int(rng.integers(0, 2 * n + 1)) if structure == "random" else n * (n - 1) // 2
        pairs = [tuple(rng.choice(n, 2, replace=False).tolist()) for _ in range(m)] if n > 1 else []
    if n > 1 and pairs and rng.random() < 0.3:
        pairs.append(pairs[0])  # a parallel edge
    def costs(shape):
        c = np.round(rng.random(shape) * 10, 1) if rng.random() < 0.5 else rng.random(shape) * 10
        if rng.random() < 0.3:
            c = np.zeros(shape) + rng.random(shape[0])[:, None] if c.ndim == 2 else c  # additive edges
        c[rng.random(shape) < inf_rate] = np.inf
        return c
    edge_costs = []
    for u, v in pairs:
        kind = rng.random()
        if kind < 0.2 and k[u] == k[v]:  # "must agree"
            c = np.full((k[u], k[v]), np.inf)
            np.fill_diagonal(c, rng.random(k[u]))
        else:
            c = costs((k[u], k[v]))
        edge_costs.append(c)
    node_costs = [costs((int(x),)) for x in k]
    node_memory = [np.round(rng.random(int(x)) * 4) for x in k]
    starts = rng.integers(0, n + 1, size=n)
    ends = starts + rng.integers(0, n + 1, size=n)
    limit = None
    if memory:
        tmp = IntraOpProblem(node_costs=node_costs, node_memory=node_memory, intervals=np.stack([starts, ends], 1))
        _, low = tmp.usage_at_points(tmp.min_memory())
        _, high = tmp.usage_at_points(np.array([m.max() for m in node_memory]))
        lo, hi = (float(low.max()), float(high.max())) if low.size else (0.0, 1.0)
        limit = lo + (hi - lo) * float(rng.choice([0.0, 0.2, 0.5, 1.0, -0.1]))
    return IntraOpProblem(
        node_costs=node_costs,
        node_memory=node_memory,
        intervals=np.stack([starts, ends], 1),
        edges=np.array(pairs, dtype=np.int64).reshape(-1, 2),
        edge_costs=edge_costs,
        memory_limit=limit,
    )


def _check_against_brute_force(problem: IntraOpProblem) -> None:
    try:
        ref = brute_force_intra_op(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_intra_op(problem, time_budget_s=20.0)
        return
    sol = solve_intra_op(problem, time_budget_s=20.0)
    sol.verify(problem)
    assert sol.optimal, sol.status
    assert np.isfinite(sol.cost)
    assert sol.cost == pytest.approx(ref.cost, rel=1e-6, abs=1e-6)
    assert sol.lower_bound is not None and sol.lower_bound <= sol.cost + 1e-6


_SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(tiny_problems(memory=False))
def test_matches_brute_force_without_memory(problem: IntraOpProblem) -> None:
    _check_against_brute_force(problem)


@_SETTINGS
@given(tiny_problems(memory=True))
def test_matches_brute_force_with_memory(problem: IntraOpProblem) -> None:
    _check_against_brute_force(problem)


@settings(max_examples=150, deadline=None)
@given(tiny_problems(memory=False, inf_rate=0.0, max_nodes=7))
def test_trees_and_chains_are_solved_by_presolve_alone(problem: IntraOpProblem) -> None:
    """Without memory, any forest is eliminated exactly by the degree-1/2 DP; nothing reaches the ILP."""
    import networkx as nx

    g = nx.MultiGraph()
    g.add_nodes_from(range(problem.num_nodes))
    g.add_edges_from(problem.edges.tolist())
    if not nx.is_forest(nx.Graph(g)):
        return
    reduced = presolve(problem)
    assert reduced.core.num_nodes == 0
    choice = reduced.expand(np.zeros(0, np.int64), problem.num_nodes)
    assert problem.cost_of(choice) == pytest.approx(brute_force_intra_op(problem).cost, rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(tiny_problems(memory=True, inf_rate=0.3))
def test_presolve_keeps_the_optimum(problem: IntraOpProblem) -> None:
    """Dominance, fixing, merging and elimination never lose the optimum: the core's best plus the
    constant equals brute force (core solved by enumeration)."""
    import itertools

    try:
        ref = brute_force_intra_op(problem)
    except InfeasibleError:
        return
    reduced = presolve(problem)
    core = reduced.core
    best = np.inf
    for c in itertools.product(*(range(x.shape[0]) for x in core.costs)):
        c = np.array(c, dtype=np.int64)
        if core.slack.size and (core.usage(c) > core.slack + 1e-9).any():
            continue
        full = reduced.expand(c, problem.num_nodes)
        cost = problem.cost_of(full)
        assert cost == pytest.approx(core.objective(c) + core.constant, rel=1e-9, abs=1e-9)
        best = min(best, cost)
    assert best == pytest.approx(ref.cost, rel=1e-9, abs=1e-9)


@settings(max_examples=120, deadline=None)
@given(tiny_problems(memory=True, inf_rate=0.1))
def test_row_generation_and_the_lagrangian_bound_agree_with_brute_force(problem: IntraOpProblem) -> None:
    """On the presolved core: row generation (memory rows added lazily) reaches the optimum, and the
    Lagrangian forest bound never exceeds it."""
    import time

    from solvers.intra_op.bound import lagrangian_bound
    from solvers.intra_op.rowgen import solve_by_row_generation

    try:
        ref = brute_force_intra_op(problem)
    except InfeasibleError:
        return
    reduced = presolve(problem)
    core = reduced.core
    if core.num_nodes == 0:
        return
    res = solve_by_row_generation(core, time.perf_counter() + 20.0)
    assert res.optimal and res.choice is not None
    full = reduced.expand(res.choice, problem.num_nodes)
    assert problem.cost_of(full) == pytest.approx(ref.cost, rel=1e-6, abs=1e-6)
    assert res.bound is not None and res.bound + core.constant <= ref.cost + 1e-6 * max(1.0, abs(ref.cost))
    bound = lagrangian_bound(core, time.perf_counter() + 0.1, upper=res.objective)
    assert bound + core.constant <= ref.cost + 1e-6 * max(1.0, abs(ref.cost))
