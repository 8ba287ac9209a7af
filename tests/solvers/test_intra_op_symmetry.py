"""Repeated structure: ``equivalence_classes`` finds the copies of a block, ``solve_intra_op(ties=)`` solves
the problem with each class held to one choice (the best uniform plan)."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_intra_op_vs_brute_force import tiny_problems

from solvers import InfeasibleError, IntraOpProblem, brute_force_intra_op, equivalence_classes, solve_intra_op


def _stack(blocks: int, *, memory_limit: float | None = None, seed: int = 0) -> IntraOpProblem:
    """An embedding node, ``blocks`` identical 3-node blocks in a chain (with a skip edge inside each), a
    head node: the shape of a transformer's forward pass. Block nodes have 3 strategies."""
    rng = np.random.default_rng(seed)
    a, b, c = (np.round(rng.random(3) * 10, 2) for _ in range(3))
    ab, bc, ac, ca = (np.round(rng.random((3, 3)) * 5, 2) for _ in range(4))
    costs, memory, edges, mats = [np.array([1.0, 2.0, 3.0])], [np.zeros(3)], [], []
    prev = 0
    for i in range(blocks):
        base = len(costs)
        costs += [a, b, c]
        memory += [np.array([4.0, 2.0, 1.0])] * 3
        edges += [(prev, base), (base, base + 1), (base + 1, base + 2), (base, base + 2)]
        mats += [ca if i else np.zeros((3, 3)), ab, bc, ac]
        prev = base + 2
    costs.append(np.array([5.0, 1.0, 3.0]))
    memory.append(np.zeros(3))
    edges.append((prev, len(costs) - 1))
    mats.append(ca)
    n = len(costs)
    intervals = np.array([[i, n + 1] if 0 < i < n - 1 else [i, i + 1] for i in range(n)])
    return IntraOpProblem(node_costs=costs, node_memory=memory, intervals=intervals, edges=edges, edge_costs=mats,
                          memory_limit=memory_limit)


def test_the_middle_blocks_of_a_stack_share_classes_and_the_ends_keep_their_own() -> None:
    p = _stack(10)
    classes = equivalence_classes(p, rounds=2)
    block = classes[1:-1].reshape(10, 3)  # block i's nodes, by position in the block
    # blocks far from both ends are copies of one another, node for node
    for i in range(3, 7):
        assert (block[i] == block[3]).all()
    # within a block the three positions differ (different costs), so do the embedding and the head
    assert len(set(block[5].tolist())) == 3
    assert classes[0] not in block and classes[-1] not in block
    # the blocks next to the embedding and the head see different neighbourhoods within two edges
    assert (block[0] != block[5]).any() and (block[9] != block[5]).any()
    # and a class never joins nodes whose costs or memory differ
    for cl in np.unique(classes):
        members = np.flatnonzero(classes == cl)
        for i in members[1:]:
            assert np.array_equal(p.node_costs[i], p.node_costs[members[0]])
            assert np.array_equal(p.node_memory[i], p.node_memory[members[0]])


def _uniform_brute_force(problem: IntraOpProblem, classes: np.ndarray) -> float:
    """The best cost over assignments that give every member of a class one strategy (inf if none fits)."""
    ids = np.unique(classes)
    k = [int(problem.num_strategies[np.flatnonzero(classes == c)[0]]) for c in ids]
    best = np.inf
    for pick in itertools.product(*(range(x) for x in k)):
        choice = np.array(pick)[np.searchsorted(ids, classes)]
        cost = problem.cost_of(choice)
        if not np.isfinite(cost) or cost >= best:
            continue
        if problem.memory_limit is not None and problem.num_nodes:
            _, usage = problem.memory_usage(choice)
            if usage.size and usage.max() > problem.memory_limit * (1 + 1e-9) + 1e-9:
                continue
        best = cost
    return best


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems(memory=True, max_nodes=7), st.integers(0, 2**32 - 1))
def test_a_tied_solve_is_the_best_uniform_assignment_of_the_original_problem(problem, seed) -> None:
    rng = np.random.default_rng(seed)
    k = problem.num_strategies
    # random classes among nodes with the same strategy count (as ties require)
    classes = np.empty(problem.num_nodes, dtype=np.int64)
    for j, kk in enumerate(np.unique(k)):
        members = np.flatnonzero(k == kk)
        classes[members] = 100 * j + rng.integers(0, max(1, members.size // 2 + 1), size=members.size)
    ref = _uniform_brute_force(problem, classes)
    if not np.isfinite(ref):
        try:
            sol = solve_intra_op(problem, time_budget_s=10.0, ties=classes)
        except InfeasibleError:
            return
        assert not sol.feasible
        return
    sol = solve_intra_op(problem, time_budget_s=10.0, ties=classes)
    sol.verify(problem)  # a tied answer is an answer of the original problem, memory included
    for c in np.unique(classes):
        assert len(set(sol.choice[classes == c].tolist())) == 1
    assert sol.cost == pytest.approx(ref, rel=1e-6, abs=1e-6)
    assert sol.cost >= brute_force_intra_op(problem).cost - 1e-6


@pytest.mark.slow  # ~75 s: the CI run keeps the unpressured symmetry cases
def test_tying_a_stack_under_memory_pressure_counts_every_copy() -> None:
    # Each block's nodes are live together to the end: with 6 blocks of 3 nodes at {4, 2, 1} bytes, a
    # limit of 40 allows at most 40 - 18 = 22 bytes over the all-1 plan. Tied, the solver must count all
    # 6 copies of a class, not one.
    free = _stack(6)
    tight = _stack(6, memory_limit=40.0)
    classes = equivalence_classes(tight)
    sol = solve_intra_op(tight, time_budget_s=10.0, ties=classes)
    sol.verify(tight)
    _, usage = tight.memory_usage(sol.choice)
    assert usage.max() <= 40.0
    assert sol.cost == pytest.approx(_uniform_brute_force(tight, classes))
    assert sol.cost >= solve_intra_op(free, time_budget_s=10.0, ties=classes).cost - 1e-9


def test_ties_between_nodes_with_different_strategy_counts_are_refused() -> None:
    p = IntraOpProblem(node_costs=[np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match="node 0 and node 1 are in one class but have 2 and 3 strategies"):
        solve_intra_op(p, ties=np.array([0, 0]))
