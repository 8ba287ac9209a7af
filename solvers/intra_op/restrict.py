r"""Large cores: the exact ILP over a few promising strategies per node (a restricted master problem).

A core too large for one ILP (IOPDDL K: 5k nodes, up to 73 strategies, 1.3M columns; HiGHS does not
finish its root LP in 150 s) is solved exactly on a *restriction*: node ``a`` keeps only the strategies
``K_a ⊆ {1..k_a}`` with ``|K_a| <= m``, where ``K_a`` holds

* the incumbent's strategy ``s_a`` (so the restriction contains the incumbent and its optimum is never
  worse), and
* the strategies cheapest at the incumbent's neighbours, ``argmin_s c_a(s) + Σ_{e=(a,b)} R^e(s, s_b)``,
  the candidates of a single-node move, up to ``m``.

The columns are then ``Σ_a |K_a| + Σ_e |K_a||K_b| <= n m + |E| m²``; ``m`` is the largest that keeps them
under ``MAX_COLUMNS``. The restricted core (``restrict``) is solved by row generation (``rowgen``) from the
incumbent until its optimum or the deadline; its answer moves many nodes at once, which single-node and
window moves cannot. Rounds repeat from the new incumbent while they improve and time is left.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core
from solvers.intra_op.rowgen import solve_by_row_generation

__all__ = ["MIN_WIDTH", "improve_by_restriction", "restrict", "restriction_width"]

MAX_COLUMNS = 150_000
# Below this many strategies a node the restriction is little more than the incumbent and its ILP is
# still hard (IOPDDL K and N, m = 2: no improvement in 90 s, at the cost of block descent's time).
MIN_WIDTH = 4


def restrict(core: Core, keep: list[np.ndarray]) -> Core:
    """``core`` with node ``a`` limited to its strategies ``keep[a]`` (indices into ``core.costs[a]``)."""
    return dataclasses.replace(
        core,
        strategies=tuple(core.strategies[a][k] for a, k in enumerate(keep)),
        costs=tuple(c[k] for c, k in zip(core.costs, keep, strict=True)),
        edge_costs=tuple(m[np.ix_(keep[a], keep[b])] for (a, b), m in zip(core.edge_nodes.tolist(), core.edge_costs,
                                                                          strict=True)),
        mem_usage=tuple(u[keep[a]] for a, u in zip(core.mem_node.tolist(), core.mem_usage, strict=True)),
    )


def restriction_width(core: Core) -> int:
    """The largest ``m`` with ``n m + |E| m² <= MAX_COLUMNS`` (at least 2)."""
    n, e = core.num_nodes, core.edge_nodes.shape[0]
    m = 2
    while n * (m + 1) + e * (m + 1) ** 2 <= MAX_COLUMNS:
        m += 1
    return m


def improve_by_restriction(core: Core, ls: LocalSearch, deadline: float) -> int:
    """Rounds of the restricted ILP from ``ls.choice`` (memory-feasible) until one finds nothing or the
    deadline passes; ``ls`` holds the best answer after. Returns the rounds that improved."""
    m = restriction_width(core)
    improved = 0
    while time.perf_counter() < deadline - 0.5:
        choice = ls.choice.copy()
        before = core.objective(choice)
        keep = []
        for a in range(core.num_nodes):
            local = ls._local_cost(a)
            order = np.argsort(local, kind="stable")
            k = [int(choice[a])] + [int(s) for s in order[: m] if s != choice[a]]
            keep.append(np.array(sorted(k[:m]), dtype=np.int64))
        sub = restrict(core, keep)
        start = np.array([int(np.searchsorted(k, s)) for k, s in zip(keep, choice.tolist(), strict=True)])
        res = solve_by_row_generation(sub, deadline, incumbent=start)
        if res.choice is None:
            break
        new = np.array([k[s] for k, s in zip(keep, res.choice.tolist(), strict=True)], dtype=np.int64)
        if core.objective(new) >= before - 1e-9 * max(1.0, abs(before)):
            break
        ls.start_from(new)
        if not ls.feasible():
            ls.start_from(choice)
            break
        improved += 1
        if not res.optimal:
            break
    return improved
