"""Simulated annealing (``anneal``): memory-feasible, never worse than its start, finds small optima."""

import time

import numpy as np
import pytest

from solvers import brute_force_intra_op, solve_intra_op
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
    assert sol.method == "annealing + windowed ILP", sol.status
    assert sol.feasible
    sol.verify(p)
    assert wall <= 1.05 * budget + 3.0  # set-up (checking the problem, presolve's graph) is not budgeted
