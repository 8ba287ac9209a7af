r"""Lagrangian local search for a large core whose memory binds: price the rows, descend, repair.

Core symbols as in ``ilp.py`` and ``bound.py``. With multipliers ``λ_r >= 0`` on the memory rows, node
``a`` taking ``s`` costs ``c_a(s) + μ_a(s)``, ``μ_a(s) = Σ_{j : a_j = a} m_{j,s} Σ_{lo_j <= r < hi_j} λ_r``,
and the rows are dropped. One round:

1. ICM (``local_search``) on the priced problem, without memory rows, from the last round's point ``x``;
2. ``λ_r`` grows by the factor ``1 + γ`` (at least to ``λ_0``) on each row that ``x`` overflows and shrinks
   by ``1 − γ/2`` on each row with more than 5% of its slack free (a multiplicative subgradient step);
3. a copy of ``x`` is repaired: while a row overflows, of the nodes with a term on the row that
   overflows most, the move freeing memory there at the least cost (edge costs at the neighbours'
   choices) per byte freed is made; then ICM with the rows (every move stays feasible) improves it.

The best feasible point seen is kept. Memory-constrained ICM alone stops where every cheaper move needs
memory another node holds; the prices move the whole assignment at once towards the nodes where memory
buys the most. (The scheme is the textbook Lagrangian heuristic for knapsack-constrained assignment.)
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core

__all__ = ["improve_by_prices"]

GAMMA = 0.3
# rounds in a row without a cheaper feasible point after which the search gives its time back
STALL_ROUNDS = 40


def improve_by_prices(core: Core, ls: LocalSearch, deadline: float) -> int:
    """Rounds of the module docstring until ``deadline`` or ``STALL_ROUNDS`` rounds in a row find nothing
    cheaper; ``ls`` ends at the best feasible point found (its start when none is cheaper). Returns the
    number of rounds that found a cheaper point."""
    if core.slack.size == 0 or not core.mem_usage or not ls.feasible():
        return 0
    best, best_obj = ls.choice.copy(), ls.objective()
    n_r = core.slack.shape[0]
    span = (core.mem_hi - core.mem_lo).astype(float)
    scale_cost = float(np.mean([np.ptp(c) for c in core.costs])) + 1e-12
    scale_mem = float(np.mean([np.ptp(u) for u in core.mem_usage])) + 1e-12
    lam0 = scale_cost / scale_mem / max(1.0, float(span.mean()))
    lam = np.zeros(n_r)
    free = LocalSearch(dataclasses.replace(core, slack=np.full(n_r, np.inf)))
    free.start_from(best)
    row_terms = _row_index(core)
    improved = stall = 0
    tol = 1e-9 * max(1.0, float(np.abs(core.slack).max()))
    while time.perf_counter() < deadline:
        cum = np.concatenate([[0.0], np.cumsum(lam)])
        weight = cum[core.mem_hi] - cum[core.mem_lo]
        priced = [c.copy() for c in core.costs]
        for a, u, w in zip(core.mem_node.tolist(), core.mem_usage, weight.tolist(), strict=True):
            if w:
                priced[a] += w * u
        free.core = dataclasses.replace(free.core, costs=tuple(priced))
        free.improve(deadline)
        x = free.choice
        over = core.usage(x) - core.slack
        lam = np.where(over > tol, np.maximum(lam * (1 + GAMMA), lam0), lam)
        lam = np.where(over < -0.05 * np.abs(core.slack), lam * (1 - GAMMA / 2), lam)
        y = _repair(core, ls, x.copy(), over, row_terms, tol, deadline)
        if y is None:
            continue
        ls.start_from(y)
        ls.improve(deadline)
        if ls.feasible() and ls.objective() < best_obj - 1e-12 * max(1.0, abs(best_obj)):
            best, best_obj = ls.choice.copy(), ls.objective()
            improved += 1
            stall = 0
        else:
            stall += 1
            if stall >= STALL_ROUNDS:
                break
    ls.start_from(best)
    return improved


def _row_index(core: Core) -> list[np.ndarray]:
    """For each row, the memory terms covering it (built once; rows x terms can be large, so by sweep)."""
    order = np.argsort(core.mem_lo, kind="stable")
    out: list[np.ndarray] = []
    active: set[int] = set()
    k = 0
    ends: dict[int, list[int]] = {}
    for j in range(len(core.mem_usage)):
        ends.setdefault(int(core.mem_hi[j]), []).append(j)
    for r in range(core.slack.shape[0]):
        for j in ends.get(r, ()):
            active.discard(j)
        while k < order.shape[0] and core.mem_lo[order[k]] <= r:
            if core.mem_hi[order[k]] > r:
                active.add(int(order[k]))
            k += 1
        out.append(np.fromiter(active, dtype=np.int64, count=len(active)))
    return out


def _repair(core: Core, ls: LocalSearch, x: np.ndarray, over: np.ndarray, row_terms: list[np.ndarray],
            tol: float, deadline: float) -> np.ndarray | None:
    """``x`` made to fit memory by the cheapest moves per byte freed on the worst row; None if stuck."""
    usage_over = over.copy()
    for _ in range(10 * core.num_nodes):
        r = int(np.argmax(usage_over))
        if usage_over[r] <= tol:
            return x
        if time.perf_counter() > deadline:
            return None
        best_ratio, move = np.inf, None
        for a in {int(core.mem_node[j]) for j in row_terms[r].tolist()}:
            # memory of ``a`` on row r for each strategy, and its local cost at the neighbours' choices
            mem = np.zeros(core.costs[a].shape[0])
            for j in ls.terms[a]:
                if core.mem_lo[j] <= r < core.mem_hi[j]:
                    mem += core.mem_usage[j]
            freed = mem[x[a]] - mem
            cost = core.costs[a].copy()
            for b, m in ls.nbrs[a]:
                cost += m[:, x[b]]
            extra = cost - cost[x[a]]
            ok = freed > 0
            if not ok.any():
                continue
            ratio = np.where(ok, np.maximum(extra, 0.0) / np.where(ok, freed, 1.0) + 1e-300 * extra, np.inf)
            s = int(np.argmin(ratio))
            if ratio[s] < best_ratio:
                best_ratio, move = ratio[s], (a, s)
        if move is None:
            return None
        a, s = move
        old = x[a]
        x[a] = s
        for j in ls.terms[a]:
            usage_over[core.mem_lo[j]:core.mem_hi[j]] += core.mem_usage[j][s] - core.mem_usage[j][old]
    return None
