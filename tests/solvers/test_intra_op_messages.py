"""Lagrangian search with message passing (``trws``): exact on trees, feasible, never worse than its start."""

import itertools
import time

import numpy as np
import pytest

from solvers import IntraOpProblem, brute_force_intra_op
from solvers.intra_op import anneal as annealing
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core, presolve
from solvers.intra_op.trws import _Messages, improve_by_messages
from tests.solvers.test_intra_op_anneal import _shared_matrices_core
from tests.solvers.test_intra_op_budget import _large_problem

pytestmark = pytest.mark.skipif(not annealing.available(), reason="numba is not installed")


def _fits(core: Core, choice: np.ndarray) -> bool:
    return bool((core.usage(choice) <= core.slack + 1e-9 * max(1.0, np.abs(core.slack).max(initial=1.0))).all())


def _tree_core(seed: int, n: int = 7) -> Core:
    """A random tree (each node tied to one earlier node) of 2-4 strategies a node, with +inf entries, no
    memory rows: TRW-S is exact on it, so the decoded point is the optimum."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(2, 5, n)
    edges = np.array([(int(rng.integers(0, b)), b) for b in range(1, n)])
    mats = []
    for a, b in edges.tolist():
        m = rng.random((ks[a], ks[b])) * 10
        m[rng.random(m.shape) < 0.15] = np.inf
        m[0, 0] = rng.random()  # one finite pair per edge: never infeasible
        mats.append(m)
    p = IntraOpProblem(node_costs=[rng.random(k) * 10 for k in ks], node_memory=[np.zeros(k) for k in ks],
                       intervals=np.stack([np.arange(n), np.arange(n) + 1], 1), edges=edges, edge_costs=mats)
    return presolve(p, deadline=0.0).core


@pytest.mark.parametrize("seed", range(6))
def test_messages_decode_the_optimum_of_a_tree(seed: int) -> None:
    core = _tree_core(seed)
    msgs = _Messages(core)
    x = np.zeros(core.num_nodes, np.int64)
    msgs.solve(msgs.flat.cost, 10, x)
    best = min(core.objective(np.array(c)) for c in itertools.product(*(range(len(c)) for c in core.costs)))
    assert core.objective(x) == pytest.approx(best, rel=1e-12)
    # converged on a tree, the messages' bound is the optimum itself
    assert msgs.lower_bound(msgs.flat.cost) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_the_chains_cover_every_edge_once_and_each_node_its_share(seed: int) -> None:
    core = _shared_matrices_core(seed)
    msgs = _Messages(core)
    entries = msgs.chain_entries[msgs.chain_entries >= 0]
    edges = sorted(tuple(sorted((int(msgs.flat.adj_nbr[p]), int(msgs.flat.adj_nbr[msgs.rev[p]])))) for p in entries)
    assert edges == sorted(tuple(sorted(e)) for e in core.edge_nodes.tolist())
    on = np.bincount(msgs.chain_nodes, minlength=core.num_nodes)
    assert np.allclose(on * msgs.share, 1.0)  # every node's unary is shared out whole


@pytest.mark.parametrize("seed", range(3))
def test_the_answer_fits_memory_and_never_costs_more_than_the_start(seed: int) -> None:
    core = _shared_matrices_core(seed)
    ls = LocalSearch(core)
    ls.start_min_memory()
    start = ls.choice.copy()
    points, bound = improve_by_messages(core, ls, time.perf_counter() + 1.0)
    assert bound <= ls.objective() * (1 + 1e-12)
    assert ls.feasible() and _fits(core, ls.choice)
    assert ls.objective() <= core.objective(start)
    assert points and all(_fits(core, p) for p in points)
    assert [core.objective(p) for p in points] == sorted(core.objective(p) for p in points)
    assert core.objective(points[0]) == ls.objective()


def test_memory_prices_find_a_cheaper_feasible_point_than_the_least_memory_start() -> None:
    core = presolve(_large_problem(800, 6, seed=3)).core
    assert core.num_nodes > 100 and core.slack.size
    ls = LocalSearch(core)
    ls.start_min_memory()
    ls.improve(time.perf_counter() + 1.0)
    start = ls.objective()
    improve_by_messages(core, ls, time.perf_counter() + 3.0)
    assert ls.feasible()
    assert ls.objective() < start


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_is_below_the_brute_force_optimum(seed: int) -> None:
    """The raw problem (loopy, memory binding) as one core: the Lagrangian bound over the rounds never
    passes the exact optimum."""
    p = _large_problem(9, 3, seed=seed)
    exact = brute_force_intra_op(p)
    core = presolve(p, deadline=0.0).core
    assert core.slack.size and core.edge_nodes.shape[0]
    ls = LocalSearch(core)
    ls.start_min_memory()
    _, bound = improve_by_messages(core, ls, time.perf_counter() + 0.3)
    assert np.isfinite(bound)
    assert bound + core.constant <= exact.cost * (1 + 1e-9) + 1e-9
    assert ls.feasible()


@pytest.mark.parametrize("seed", range(3))
def test_the_messages_bound_is_below_every_point_of_a_loopy_core(seed: int) -> None:
    """Without memory (a loopy core of 120 nodes): the chain bound at any messages is below the cost of
    the decoded point and of random points."""
    core = _shared_matrices_core(seed)
    msgs = _Messages(core)
    x = np.zeros(core.num_nodes, np.int64)
    rng = np.random.default_rng(seed)
    for it in (0, 1, 5, 20):  # 0: no messages yet
        if it:
            msgs.solve(msgs.flat.cost, it, x)
        lb = msgs.lower_bound(msgs.flat.cost)
        if it:
            assert lb <= core.objective(x) * (1 + 1e-12)
        for _ in range(20):
            y = np.array([rng.integers(len(c)) for c in core.costs])
            obj = core.objective(y)
            assert not np.isfinite(obj) or lb <= obj * (1 + 1e-12)


def test_a_core_without_memory_rows_is_solved_once() -> None:
    core = _tree_core(1, 8)
    ls = LocalSearch(core)
    ls.start_from(np.zeros(core.num_nodes, np.int64))
    t0 = time.perf_counter()
    improve_by_messages(core, ls, time.perf_counter() + 5.0)
    assert time.perf_counter() - t0 < 4.0  # one round, not the whole time
    best = min(core.objective(np.array(c)) for c in itertools.product(*(range(len(c)) for c in core.costs)))
    assert ls.objective() == pytest.approx(best, rel=1e-12)
