"""Exhaustive reference solver for tiny intra-operator problems (tests cross-check the real solver)."""

from __future__ import annotations

import itertools
import time

import numpy as np

from solvers.intra_op.problem import InfeasibleError, IntraOpProblem
from solvers.intra_op.solution import IntraOpSolution, PresolveStats

__all__ = ["brute_force_intra_op"]


def brute_force_intra_op(problem: IntraOpProblem, *, max_assignments: int = 2_000_000) -> IntraOpSolution:
    """Enumerate every assignment; return the cheapest finite one that fits in memory.

    Ties go to the lexicographically smallest assignment. Raises InfeasibleError when none exists and
    ValueError when there are more than ``max_assignments`` assignments.
    """
    problem.verify()
    start = time.perf_counter()
    k = problem.num_strategies
    total = int(np.prod(k, dtype=np.float64)) if k.size else 1
    if total > max_assignments:
        raise ValueError(f"{total} assignments is too many to enumerate (max_assignments={max_assignments})")
    best: tuple[float, tuple[int, ...]] | None = None
    limit = problem.memory_limit
    for choice in itertools.product(*(range(int(x)) for x in k)):
        cost = problem.cost_of(choice)
        if not np.isfinite(cost) or (best is not None and cost >= best[0]):
            continue
        if limit is not None and problem.num_nodes:
            _, usage = problem.memory_usage(choice)
            if usage.size and usage.max() > limit * (1 + 1e-9) + 1e-9:
                continue
        best = (cost, choice)
    if best is None:
        problem.check_memory_lower_bound()
        raise InfeasibleError("every assignment has infinite cost or exceeds the memory limit")
    n, m, s = problem.num_nodes, problem.num_edges, int(k.sum())
    stats = PresolveStats(
        nodes_before=n, edges_before=m, strategies_before=s, nodes_after=n, edges_after=m, strategies_after=s
    )
    return IntraOpSolution(
        choice=np.array(best[1], dtype=np.int64),
        cost=best[0],
        optimal=True,
        lower_bound=best[0],
        status="optimal",
        solve_seconds=time.perf_counter() - start,
        stats=stats,
        method="brute force",
    )
