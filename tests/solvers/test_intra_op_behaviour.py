"""Behaviour of the intra-op solver beyond optimality: errors, +inf handling, time budget, JSON, presolve."""

import json
from pathlib import Path

import numpy as np
import pytest

from solvers import InfeasibleError, IntraOpProblem, IntraOpSolution, brute_force_intra_op, solve_intra_op
from solvers.intra_op.io_json import problem_from_dict, problem_to_dict
from solvers.intra_op.presolve import presolve

INF = np.inf


def _grid(n: int, k: int, seed: int, *, memory: bool) -> IntraOpProblem:
    """An n×n grid (loopy, so presolve leaves a real core) with random costs."""
    rng = np.random.default_rng(seed)
    idx = np.arange(n * n).reshape(n, n)
    edges = [(idx[i, j], idx[i, j + 1]) for i in range(n) for j in range(n - 1)]
    edges += [(idx[i, j], idx[i + 1, j]) for i in range(n - 1) for j in range(n)]
    mem = [rng.integers(1, 5, k).astype(float) for _ in range(n * n)]
    starts = rng.integers(0, n, n * n)
    p = IntraOpProblem(
        node_costs=[rng.random(k) * 10 for _ in range(n * n)],
        node_memory=mem,
        intervals=np.stack([starts, starts + rng.integers(1, n, n * n)], 1),
        edges=np.array(edges),
        edge_costs=[rng.random((k, k)) * 10 for _ in edges],
    )
    if not memory:
        return p
    _, low = p.usage_at_points(p.min_memory())
    return IntraOpProblem(node_costs=p.node_costs, node_memory=p.node_memory, intervals=p.intervals,
                          edges=p.edges, edge_costs=p.edge_costs, memory_limit=float(low.max()) * 1.2)


def test_memory_infeasible_error_names_the_tightest_step_and_nodes() -> None:
    p = IntraOpProblem(
        node_costs=[np.array([1.0, 2.0]), np.array([1.0, 1.0]), np.array([3.0])],
        node_memory=[np.array([4.0, 3.0]), np.array([5.0, 6.0]), np.array([1.0])],
        intervals=np.array([[0, 3], [2, 4], [5, 6]]),
        memory_limit=7.0,
        node_names=["dot_general @ model.py:42", "add @ model.py:43", "loss"],
    )
    with pytest.raises(InfeasibleError) as info:
        solve_intra_op(p)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.time == 2 and err.min_usage == pytest.approx(8.0) and err.limit == pytest.approx(7.0)
    assert err.nodes[0] == 1 and set(err.nodes) == {0, 1}
    msg = str(err)
    assert "t=2" in msg and "8" in msg and "dot_general @ model.py:42" in msg and "add @ model.py:43" in msg


def test_all_infinite_problem_raises_clear_error() -> None:
    p = IntraOpProblem(
        node_costs=[np.array([1.0, 2.0]), np.array([1.0, 1.0])],
        edges=np.array([[0, 1]]),
        edge_costs=[np.array([[INF, INF], [INF, INF]])],
        node_names=["a", "b"],
    )
    with pytest.raises(InfeasibleError, match="no finite-cost assignment"):
        solve_intra_op(p)


def test_couplings_that_defeat_the_memory_bound_are_reported() -> None:
    """Each node alone can be small, but 'must agree' edges force a big one: proven infeasible."""
    must_agree = np.array([[0.0, INF], [INF, 0.0]])
    p = IntraOpProblem(
        node_costs=[np.array([0.0, 0.0]), np.array([0.0, 0.0]), np.array([0.0, 0.0])],
        node_memory=[np.array([1.0, 5.0]), np.array([5.0, 1.0]), np.array([1.0, 1.0])],
        intervals=np.array([[0, 2], [0, 2], [0, 3]]),
        edges=np.array([[0, 1], [1, 2], [0, 2]]),
        edge_costs=[must_agree, np.ones((2, 2)), np.ones((2, 2))],
        memory_limit=4.0,
    )
    with pytest.raises(InfeasibleError, match="tightest time step"):
        solve_intra_op(p)


def test_inf_is_never_chosen_when_a_finite_choice_exists() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        n, k = 7, 3
        costs = [np.where(rng.random(k) < 0.3, INF, rng.random(k)) for _ in range(n)]
        for c in costs:
            c[rng.integers(k)] = rng.random()  # at least one finite strategy
        edges = np.array([(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.5] or [(0, 1)])
        ecs = []
        for _ in edges:
            m = np.where(rng.random((k, k)) < 0.4, INF, rng.random((k, k)))
            ecs.append(m)
        p = IntraOpProblem(node_costs=costs, edges=edges, edge_costs=ecs)
        try:
            ref = brute_force_intra_op(p)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_intra_op(p)
            continue
        sol = solve_intra_op(p)
        assert np.isfinite(sol.cost) and sol.cost == pytest.approx(ref.cost)


def test_parallel_edges_add_up() -> None:
    a = np.array([[0.0, 5.0], [5.0, 0.0]])
    p = IntraOpProblem(
        node_costs=[np.array([0.0, 1.0]), np.array([3.0, 0.0])],
        edges=np.array([[0, 1], [1, 0]]),
        edge_costs=[a, a.T * 2],
    )
    sol = solve_intra_op(p)
    assert sol.cost == pytest.approx(brute_force_intra_op(p).cost) == pytest.approx(1.0)
    assert p.cost_of([0, 1]) == pytest.approx(0.0 + 0.0 + 5.0 + 10.0)


def test_follow_edges_are_merged_and_trees_need_no_ilp() -> None:
    """A chain where each op must agree with its operand collapses to one node."""
    k, n = 4, 50
    agree = np.where(np.eye(k) > 0, 0.0, INF)
    rng = np.random.default_rng(0)
    p = IntraOpProblem(
        node_costs=[rng.random(k) for _ in range(n)],
        edges=np.array([(i, i + 1) for i in range(n - 1)]),
        edge_costs=[agree] * (n - 1),
    )
    sol = solve_intra_op(p)
    assert sol.optimal and sol.stats.nodes_after == 0 and sol.method == "presolve"
    assert len(set(sol.choice.tolist())) == 1
    assert sol.cost == pytest.approx(min(sum(c[s] for c in p.node_costs) for s in range(k)))


def test_dominated_strategies_are_removed_without_losing_the_optimum() -> None:
    rng = np.random.default_rng(1)
    for seed in range(20):
        p = _grid(3, 3, seed, memory=bool(seed % 2))
        # make strategy 2 of every node a worse copy of strategy 0
        costs = [np.array([c[0], c[1], c[0] + 1.0]) for c in p.node_costs]
        mem = [np.array([m[0], m[1], m[0] + rng.integers(0, 2)]) for m in p.node_memory]
        ecs = [np.array(m) for m in p.edge_costs]
        for m in ecs:
            m[2, :] = m[0, :] + 0.5
            m[:, 2] = m[:, 0] + 0.5
            m[2, 2] = m[0, 0] + 1
        q = IntraOpProblem(node_costs=costs, node_memory=mem, intervals=p.intervals, edges=p.edges,
                           edge_costs=ecs, memory_limit=p.memory_limit)
        try:
            reduced = presolve(q)
        except InfeasibleError:
            continue  # the copied limit no longer fits; nothing to compare
        assert reduced.counts["dominated"] >= 1 or reduced.core.num_nodes == 0
        assert all(2 not in s for s in reduced.core.strategies)
        try:
            ref = brute_force_intra_op(q)
        except InfeasibleError:
            continue
        assert solve_intra_op(q).cost == pytest.approx(ref.cost)


def test_tiny_budget_still_returns_a_feasible_answer() -> None:
    p = _grid(12, 8, 0, memory=True)
    sol = solve_intra_op(p, time_budget_s=0.5, max_ilp_columns=10**9)
    assert sol.feasible and not sol.optimal
    assert "time budget" in sol.status
    sol.verify(p)
    assert sol.lower_bound is not None and sol.lower_bound <= sol.cost


def test_windowed_search_path_returns_a_verified_answer() -> None:
    p = _grid(6, 4, 2, memory=True)
    sol = solve_intra_op(p, time_budget_s=3.0, max_ilp_columns=10)
    sol.verify(p)
    assert sol.feasible and not sol.optimal and "windows" in sol.status
    exact = solve_intra_op(p, time_budget_s=30.0)
    assert exact.optimal and sol.cost >= exact.cost - 1e-6


def test_json_round_trip(tmp_path) -> None:
    p = _grid(3, 3, 5, memory=True)
    p = IntraOpProblem(node_costs=[np.where(np.arange(3) == 1, INF, c) for c in p.node_costs],
                       node_memory=p.node_memory, intervals=p.intervals, edges=p.edges,
                       edge_costs=p.edge_costs, memory_limit=p.memory_limit,
                       node_names=[f"op{i} @ f.py:{i}" for i in range(9)])
    for name in ("p.json", "p.json.gz"):
        p.to_json(tmp_path / name)
        q = IntraOpProblem.from_json(tmp_path / name)
        assert q.node_names == p.node_names and q.memory_limit == p.memory_limit
        np.testing.assert_array_equal(q.intervals, p.intervals)
        np.testing.assert_array_equal(q.edges, p.edges)
        for a, b in zip(q.node_costs + q.node_memory + q.edge_costs,
                        p.node_costs + p.node_memory + p.edge_costs, strict=True):
            np.testing.assert_array_equal(a, b)
    d = problem_to_dict(p)
    with pytest.raises(ValueError, match="unsupported version"):
        problem_from_dict({**d, "version": 99})
    with pytest.raises(ValueError, match="format"):
        problem_from_dict({**d, "format": "other"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(node_costs=[[1.0, np.nan]]), "node 0.*NaN"),
        (dict(node_costs=[[1.0]], node_memory=[[1.0, 2.0]]), "memory entries"),
        (dict(node_costs=[[1.0], [2.0]], intervals=[[3, 1], [0, 1]], node_names=["x", "y"]), "'x'.*start > end"),
        (dict(node_costs=[[1.0], [2.0]], edges=[[0, 2]], edge_costs=[[[0.0]]]), "edge 0"),
        (dict(node_costs=[[1.0], [2.0, 3.0]], edges=[[0, 1]], edge_costs=[[[0.0]]]), r"expected \(1, 2\)"),
        (dict(node_costs=[[1.0]], edges=[[0, 0]], edge_costs=[[[0.0]]]), "self-loop"),
        (dict(node_costs=[[-np.inf]]), "-inf"),
    ],
)
def test_verify_names_the_bad_node_or_edge(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        IntraOpProblem(**kwargs).verify()


def test_solution_verify_catches_wrong_cost_and_memory() -> None:
    p = IntraOpProblem(node_costs=[np.array([1.0, 2.0])], node_memory=[np.array([5.0, 1.0])], memory_limit=2.0)
    sol = solve_intra_op(p)
    assert sol.choice.tolist() == [1]
    bad = IntraOpSolution(choice=np.array([1]), cost=9.0, optimal=True, lower_bound=None, status="x",
                          solve_seconds=0.0, stats=sol.stats)
    with pytest.raises(ValueError, match="differs"):
        bad.verify(p)
    over = IntraOpSolution(choice=np.array([0]), cost=1.0, optimal=True, lower_bound=None, status="x",
                           solve_seconds=0.0, stats=sol.stats)
    with pytest.raises(ValueError, match="exceeds the limit"):
        over.verify(p)


def test_cbc_backend_agrees_with_highs() -> None:
    p = _grid(3, 3, 7, memory=True)
    try:
        ref = brute_force_intra_op(p)
    except InfeasibleError:
        pytest.skip("random instance infeasible")
    sol = solve_intra_op(p, backend="cbc", time_budget_s=30.0)
    assert sol.cost == pytest.approx(ref.cost, rel=1e-6)


def test_a_solve_prints_nothing_on_the_terminal() -> None:
    """highspy 1.16 prints a banner on a process's first ``Highs()``: a user's plan output must not carry it.
    A fresh interpreter (the banner shows once per process) solves a loopy problem through HiGHS, with
    memory rows so that row generation runs too."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.path.insert(0, 'tests/solvers'); from test_intra_op_behaviour import _grid; "
            "from solvers import solve_intra_op; s = solve_intra_op(_grid(6, 3, 0, memory=True), time_budget_s=20); "
            "print('cost', s.cost, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert "cost" in out.stderr
    assert out.stdout == ""


DATA = Path(__file__).parent.parent / "data" / "solver"


def test_an_ilp_in_seconds_reaches_the_optimum_a_local_search_found() -> None:
    """GPT-1T's block on a 3x8 submesh (its update ops; the planner's costs are seconds, the largest 0.64, the
    smallest 2e-19). HiGHS given those costs as they are declared optimal an answer 0.18% above a known
    feasible one (``….known.json``, found by the windowed local search); the ILP's objective is scaled
    (``ilp.OBJECTIVE_SCALE``), and the answer is now at least as good as the known one, proven."""
    p = IntraOpProblem.from_json(DATA / "gpt1t_block_3x8_update.json.gz")
    known = np.array(json.loads((DATA / "gpt1t_block_3x8_update.known.json").read_text()))
    sol = solve_intra_op(p, time_budget_s=20.0)
    assert sol.method == "ilp" and sol.optimal
    assert sol.cost <= p.cost_of(known) * (1 + 1e-9)
    assert sol.lower_bound == pytest.approx(sol.cost, rel=1e-6)


@pytest.mark.parametrize("unit", [1e-6, 1.0, 1e6])
def test_the_answer_does_not_depend_on_the_unit_of_cost(unit: float) -> None:
    """The same problem in seconds, microseconds or megaseconds: the same optimum, scaled, and a lower bound
    in the problem's own unit (the ILP's objective is scaled for HiGHS and its bound scaled back)."""
    base = _grid(3, 3, 11, memory=True)
    p = IntraOpProblem(node_costs=[c * unit for c in base.node_costs], node_memory=base.node_memory,
                       intervals=base.intervals, edges=base.edges, edge_costs=[m * unit for m in base.edge_costs],
                       memory_limit=base.memory_limit)
    ref = brute_force_intra_op(base)
    sol = solve_intra_op(p, time_budget_s=20.0)
    assert sol.optimal
    assert sol.cost == pytest.approx(ref.cost * unit, rel=1e-9)
    assert sol.lower_bound == pytest.approx(sol.cost, rel=1e-6)


def test_a_small_core_is_proven_optimal_in_a_short_solve() -> None:
    """The same layer given half a second, as the pipeline's layer pricing gives it: its 6k-column core goes
    to one ILP (``solve.small_ilp``) and is proven optimal, where the local search + windows path used to
    run to its deadline and stop wherever it stood then (a price that moved with the machine's load)."""
    p = IntraOpProblem.from_json(DATA / "gpt1t_block_3x8_update.json.gz")
    known = np.array(json.loads((DATA / "gpt1t_block_3x8_update.known.json").read_text()))
    # 1 s of wall clock: the suite runs on two xdist workers sharing two cores, where half a second of wall
    # clock left HiGHS about a quarter of a core-second and the proof failed (CI, 2026-11-27); still a
    # fraction of what the windowed search would take, and the claim is the same: one ILP, proven
    sol = solve_intra_op(p, time_budget_s=1.0)
    assert sol.method == "ilp" and sol.optimal
    assert sol.cost <= p.cost_of(known) * (1 + 1e-9)
