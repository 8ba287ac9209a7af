"""Lagrangian local search (``lagrange_search``): memory that one node holds goes to the node it saves most."""

import time

import numpy as np

from solvers.intra_op.lagrange_search import improve_by_prices
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core, presolve
from tests.solvers.test_intra_op_budget import _large_problem


def _two_nodes_one_slot() -> Core:
    # both nodes live on the one row, which has room for one large strategy: strategy 0 is large and
    # free, strategy 1 small and dear (node 0 saves 10 by going large, node 1 saves 1)
    return Core(
        nodes=np.arange(2), strategies=(np.arange(2), np.arange(2)),
        costs=(np.array([0.0, 10.0]), np.array([0.0, 1.0])),
        edge_nodes=np.zeros((0, 2), dtype=np.int64), edge_costs=(),
        mem_node=np.array([0, 1]), mem_lo=np.array([0, 0]), mem_hi=np.array([1, 1]),
        mem_usage=(np.array([5.0, 1.0]), np.array([5.0, 1.0])), slack=np.array([6.0]), constant=0.0,
    )


def test_memory_moves_to_the_node_that_saves_most() -> None:
    core = _two_nodes_one_slot()
    ls = LocalSearch(core)
    ls.start_from(np.array([1, 0]))  # node 1 holds the slot: ICM alone cannot move (no room for node 0)
    ls.improve(time.perf_counter() + 1.0)
    assert ls.objective() == 10.0
    improve_by_prices(core, ls, time.perf_counter() + 2.0)
    assert ls.feasible()
    assert ls.objective() == 1.0
    assert ls.choice.tolist() == [0, 1]


def test_the_answer_fits_memory_and_never_costs_more_than_the_start() -> None:
    p = _large_problem(800, 6, seed=3)
    core = presolve(p).core
    assert core.num_nodes > 100 and core.slack.size
    ls = LocalSearch(core)
    ls.start_min_memory()
    ls.improve(time.perf_counter() + 1.0)
    before = ls.objective()
    improve_by_prices(core, ls, time.perf_counter() + 2.0)
    assert ls.feasible()
    assert (core.usage(ls.choice) <= core.slack + 1e-9 * np.abs(core.slack).max()).all()
    assert ls.objective() <= before
    print(f"start {before:.1f}, after prices {ls.objective():.1f}")
