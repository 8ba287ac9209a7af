"""Simulated annealing (``anneal``): memory-feasible, never worse than its start, finds small optima."""

import dataclasses
import time

import numpy as np
import pytest

from solvers import IntraOpProblem, brute_force_intra_op, solve_intra_op
from solvers.intra_op import anneal as annealing
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core, presolve
from tests.solvers.test_intra_op_budget import _large_problem
from tests.solvers.test_intra_op_prices import _two_nodes_one_slot

pytestmark = pytest.mark.skipif(not annealing.available(), reason="numba is not installed")


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    """Compile the loop once (a fresh machine has no numba cache yet: 3-10 s) so that the budgets below
    are spent annealing: a call with its deadline already passed compiles and returns its start."""
    core = _two_nodes_one_slot()
    assert annealing.anneal(core, np.array([1, 0]), time.perf_counter()).tolist() == [1, 0]


def _fits(core: Core, choice: np.ndarray) -> bool:
    return bool((core.usage(choice) <= core.slack + 1e-9 * max(1.0, np.abs(core.slack).max(initial=1.0))).all())


def test_the_answer_fits_memory_and_never_costs_more_than_the_start() -> None:
    core = presolve(_large_problem(800, 6, seed=3)).core
    assert core.num_nodes > 100 and core.slack.size
    ls = LocalSearch(core)
    ls.start_min_memory()
    ls.improve(time.perf_counter() + 1.0)
    start = ls.choice.copy()
    out = annealing.anneal(core, start, time.perf_counter() + 3.0)
    assert _fits(core, out)
    # annealing from an ICM local optimum finds a cheaper feasible point on this loopy, memory-bound core
    assert core.objective(out) < core.objective(start)


def test_the_memory_slot_goes_to_the_node_that_saves_most() -> None:
    out = annealing.anneal(_two_nodes_one_slot(), np.array([1, 0]), time.perf_counter() + 0.5)
    assert out.tolist() == [0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_small_problems_reach_the_brute_force_optimum(seed: int) -> None:
    p = _large_problem(9, 3, seed=seed)
    exact = brute_force_intra_op(p)
    # the raw problem as one core (no presolve: annealing sees every node, edge and memory row)
    core = presolve(p, deadline=0.0).core
    ls = LocalSearch(core)
    ls.start_min_memory()
    assert ls.feasible()
    out = annealing.anneal(core, ls.choice, time.perf_counter() + 0.5, seed=seed)
    assert _fits(core, out)
    assert core.objective(out) + core.constant == pytest.approx(exact.cost, rel=1e-9)


def test_a_large_core_with_time_enough_is_annealed_within_its_budget(monkeypatch) -> None:
    # the loop is compiled (``_compiled``); 5 s of annealing stand for the solve's minimum
    monkeypatch.setattr(annealing, "MIN_SECONDS", 5.0)
    p = _large_problem(3000, 8, seed=5)
    budget = 8.0
    t0 = time.perf_counter()
    sol = solve_intra_op(p, time_budget_s=budget, max_ilp_columns=1000)
    wall = time.perf_counter() - t0
    assert sol.method == "messages + annealing + windowed ILP", sol.status
    assert sol.feasible
    sol.verify(p)
    assert wall <= 1.05 * budget + 3.0  # set-up (checking the problem, presolve's graph) is not budgeted


def _shared_matrices_core(seed: int) -> Core:
    """A loopy core whose nodes have 2-5 strategies and whose edges draw their matrices from a small pool
    (as on IOPDDL, where edges between nodes of one kind share theirs), one of them with +inf entries."""
    rng = np.random.default_rng(seed)
    n = 120
    ks = rng.integers(2, 6, n)
    pool = {(a, b): [rng.random((a, b)) * 10 for _ in range(3)] for a in range(2, 6) for b in range(2, 6)}
    pool[(3, 3)][0][0, 1] = np.inf
    u = rng.integers(1, n, 3 * n)
    v = rng.integers(0, u)
    edges = np.unique(np.stack([v, u], 1), axis=0)
    p = IntraOpProblem(
        node_costs=[rng.random(k) * 10 for k in ks],
        node_memory=[rng.integers(1, 8, k).astype(float) for k in ks],
        intervals=np.stack([np.arange(n), np.arange(n) + 1 + rng.geometric(0.1, n)], 1),
        edges=edges,
        edge_costs=[pool[(ks[a], ks[b])][rng.integers(3)] for a, b in edges.tolist()],
    )
    _, low = p.usage_at_points(p.min_memory())
    p = dataclasses.replace(p, memory_limit=float(low.max()) * 1.3)
    return presolve(p, deadline=0.0).core


def test_each_adjacency_entry_reads_its_edge_matrix_from_its_own_side() -> None:
    core = _shared_matrices_core(0)
    flat = annealing._Flat(core)
    assert flat.omats.size < 2 * sum(m.size for m in core.edge_costs)  # shared matrices are stored once
    seen = 0
    for (a, b), m in zip(core.edge_nodes.tolist(), core.edge_costs, strict=True):
        for me, other, mat in ((a, b, m), (b, a, m.T)):
            p = next(q for q in range(flat.adj_off[me], flat.adj_off[me + 1])
                     if flat.adj_nbr[q] == other and np.array_equal(
                         flat.omats[flat.adj_omoff[q]:flat.adj_omoff[q] + mat.size],
                         np.where(np.isfinite(mat), mat, flat.penalty).ravel()))
            seen += p >= 0
    assert seen == 2 * core.edge_nodes.shape[0]


@pytest.mark.parametrize("mode", ["priced", "hard", "soft"])
@pytest.mark.parametrize("compound", [0.0, 0.3, 1.0])
def test_the_walks_running_cost_stays_the_cost_of_where_it_stands(mode: str, compound: float) -> None:
    # each move's Δ comes from the local costs the loop keeps up to date (a single move's only once it
    # is kept); a slip in that bookkeeping shows as a running cost that drifts from the true one
    core = _shared_matrices_core(1)
    flat = annealing._Flat(core)
    run, _ = annealing._kernel()
    rng = np.random.default_rng(2)
    ls = LocalSearch(core)
    ls.start_min_memory()
    ls.improve(time.perf_counter() + 0.2)
    x = ls.choice.astype(np.int64)
    assert _fits(core, x) and np.isfinite(core.objective(x))
    best_x = x.copy()
    cur = core.objective(x)
    lam = np.full(8, {"priced": 0.0, "hard": -1.0, "soft": 1e-2}[mode])
    price = rng.random(flat.cost.shape[0])
    graph = (flat.k, flat.koff, flat.cost, flat.adj_off, flat.adj_nbr, flat.adj_omoff, flat.omats)
    memory = (flat.term_off, flat.term_lo, flat.term_hi, flat.term_uoff, flat.usage)
    mx, lz = flat.tree(core, x)
    for chunk in range(3):
        cur, best = run(x, best_x, cur, annealing.UNSEEN, 5.0, 0.5, 20_000, chunk, flat.tol, compound, lam, 0.05,
                        price, *graph, *memory, mx, lz, flat.size, annealing.MAX_DEG_FOLLOW, annealing.MAX_HOPS_LOG,
                        annealing.MAX_MOVED, flat.term_node, flat.stab_off, flat.stab_terms, 8, 0.5)
        assert cur == pytest.approx(core.objective(x), rel=1e-9)
        if best < annealing.UNSEEN:
            assert best == pytest.approx(core.objective(best_x), rel=1e-9)
            assert _fits(core, best_x)
