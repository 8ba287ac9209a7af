"""The answer to an intra-operator problem: one strategy per node, its cost, and how sure we are of it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solvers.intra_op.problem import IntraOpProblem

__all__ = ["IntraOpSolution", "PresolveStats"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PresolveStats:
    """Sizes before and after the exact reductions, and what removed the difference."""

    nodes_before: int
    edges_before: int
    strategies_before: int
    nodes_after: int
    edges_after: int
    strategies_after: int
    memory_rows: int = 0
    dominated_strategies: int = 0
    fixed_nodes: int = 0
    merged_nodes: int = 0
    eliminated_nodes: int = 0
    dropped_edges: int = 0


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class IntraOpSolution:
    """``choice[i]`` is the strategy of node ``i``; ``cost`` is the problem's objective at ``choice``.

    ``optimal`` is True only when the answer is proven optimal; ``lower_bound`` is a proven bound on the
    optimum when one is known (equal to ``cost`` when optimal). ``status`` says how the solve ended, e.g.
    ``"optimal"``, ``"feasible (time budget reached)"``; ``feasible`` is False only when the time ran out
    before any memory-feasible assignment was found (then ``choice`` is the least-violating one seen).
    """

    choice: np.ndarray
    cost: float
    optimal: bool
    lower_bound: float | None
    status: str
    solve_seconds: float
    stats: PresolveStats
    feasible: bool = True
    method: str = ""

    @staticmethod
    def unsolved(problem: IntraOpProblem, choice: np.ndarray, cost: float, status: str) -> IntraOpSolution:
        """``choice`` as the answer, with no solve run (a start taken as it is): not proven, no bound."""
        n, m, k = problem.num_nodes, problem.num_edges, int(problem.num_strategies.sum())
        stats = PresolveStats(nodes_before=n, edges_before=m, strategies_before=k, nodes_after=n, edges_after=m,
                              strategies_after=k)
        return IntraOpSolution(choice=choice, cost=cost, optimal=False, lower_bound=None, status=status,
                               solve_seconds=0.0, stats=stats)

    @property
    def gap(self) -> float | None:
        """Relative gap ``(cost - lower_bound) / max(|cost|, 1e-12)``, or None without a bound."""
        if self.lower_bound is None or not np.isfinite(self.cost):
            return None
        return max(0.0, (self.cost - self.lower_bound) / max(abs(self.cost), 1e-12))

    def verify(self, problem: IntraOpProblem, *, rtol: float = 1e-6) -> None:
        """Raise ValueError unless ``choice`` is in range, ``cost`` matches and memory fits."""
        choice = np.asarray(self.choice)
        if choice.shape != (problem.num_nodes,):
            raise ValueError(f"choice has shape {choice.shape}; the problem has {problem.num_nodes} nodes")
        k = problem.num_strategies
        bad = np.flatnonzero((choice < 0) | (choice >= k))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{problem.node_label(i)}: strategy {choice[i]} is outside 0..{k[i] - 1}")
        cost = problem.cost_of(choice)
        if not np.isfinite(cost):
            raise ValueError("the chosen assignment has infinite cost (a forbidden strategy or pair)")
        if not np.isclose(cost, self.cost, rtol=rtol, atol=1e-9 * max(1.0, abs(cost))):
            raise ValueError(f"recorded cost {self.cost!r} differs from the recomputed cost {cost!r}")
        if self.lower_bound is not None and self.lower_bound > cost + rtol * max(1.0, abs(cost)):
            raise ValueError(f"lower bound {self.lower_bound!r} exceeds the cost {cost!r}")
        if problem.memory_limit is not None and problem.num_nodes:
            points, usage = problem.memory_usage(choice)
            limit = problem.memory_limit
            over = np.flatnonzero(usage > limit + rtol * max(1.0, abs(limit)))
            if over.size:
                t = int(over[0])
                raise ValueError(f"memory {usage[t]:.6g} exceeds the limit {limit:.6g} at time {points[t]}")
