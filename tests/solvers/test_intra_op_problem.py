"""IntraOpProblem as data: read-only, copied from what a caller can still change, shared between problems."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from solvers import IntraOpProblem


def test_a_callers_arrays_are_copied_and_frozen() -> None:
    costs, edge = np.array([1.0, 2.0]), np.ones((2, 2))
    p = IntraOpProblem(node_costs=[costs, [3.0, 4.0]], edges=[[0, 1]], edge_costs=[edge])
    costs[0] = edge[0, 0] = 99.0
    assert p.node_costs[0][0] == 1.0 and p.edge_costs[0][0, 0] == 1.0
    with pytest.raises(ValueError):
        p.node_costs[1][0] = 0.0


def test_a_replaced_problem_shares_the_frozen_arrays_of_the_original() -> None:
    """``dataclasses.replace`` (a pinned seed, a memory limit) does not copy every node's and edge's costs
    again: the planner replaces a 20k-node problem dozens of times per plan."""
    p = IntraOpProblem(node_costs=[np.arange(3.0), np.arange(2.0)], node_memory=[np.ones(3), np.ones(2)],
                       edges=[[0, 1]], edge_costs=[np.zeros((3, 2))])
    q = dataclasses.replace(p, memory_limit=5.0, node_costs=[np.full(3, 7.0), p.node_costs[1]])
    assert q.node_costs[1] is p.node_costs[1] and q.edge_costs[0] is p.edge_costs[0]
    assert q.node_memory[0] is p.node_memory[0] and q.memory_limit == 5.0 and q.node_costs[0][0] == 7.0
    assert q.edge_costs[0].shape == (3, 2)
